"""GRPO advantages and the policy loss with its off-policy corrections.

Per token, with log-prob `logp` under the weights being trained, behaviour log-prob `mu` (vLLM, the weights
that sampled the token), the proximal log-prob `prox` (the weights before the batch's first update) and the
group advantage `A`:

  none       r = exp(logp - prox);               loss = -min(r A, clip(r, 1-eps, 1+eps) A)
             no off-policy correction at all: a stale sample is trained as if the current weights had sampled it
             (GRPO as on-policy trainers run it, TRL's without its importance-sampling correction); the baseline
             that shows what the corrections are worth
  ppo        r = exp(logp - mu);                 loss = -min(r A, clip(r, 1-eps, 1+eps) A)
  tis        w = min(exp(sg(logp) - mu), C);     loss = -w A exp(logp - sg(logp))     (value -wA, grad -wA dlogp)
  decoupled  w = min(exp(prox - mu), C); r = exp(logp - prox);
                                                 loss = -w min(r A, clip(r, 1-eps, 1+eps) A)
  masked     w = exp(prox - mu), 0 outside [lo, hi] (IcePop: masked, not truncated); r and loss as decoupled

`sg` stops the gradient. With one optimizer step per batch (trainer.minibatches 1) prox = sg(logp), so r = 1
in value and its clip never acts; with several, later updates see r move away from 1 and the clip acts.
Token-level normalisation: an update's loss is the sum over its trained tokens divided by their count (each
micro-batch contributes its sum / the update's total).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [groups, G] -> (advantages [groups, G], zero-variance mask [groups]).

    A = r - mean(r), divided by the group's (unbiased) standard deviation + eps when `scale`.
    Groups whose rewards are all equal carry no signal: their advantages are 0 and they are flagged.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    adv = rewards - mean
    if scale:
        adv = adv / (std + eps)
    zero = std.squeeze(1) < 1e-8
    adv[zero] = 0.0
    return adv, zero


def token_loss(logp: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor, variant: str, clip_eps: float = 0.2,
               is_cap: float = 2.0, prox: torch.Tensor | None = None,
               token_mask: Sequence[float] = (0.5, 2.0)) -> tuple[torch.Tensor, dict]:
    """Per-token loss (same shape as logp) and detached per-token statistics of the correction: `is_weight`
    (the weight applied), `clipped` (the ratio's clip acted), `masked` (the token mask left it out)."""
    prox = logp.detach() if prox is None else prox
    masked = torch.zeros_like(logp)
    if variant == "none":
        ratio = torch.exp(logp - prox)
        loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
        weight = torch.ones_like(ratio)
    elif variant == "ppo":
        ratio = torch.exp(logp - mu)
        loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
        weight = torch.ones_like(ratio)
    elif variant == "tis":
        sg = logp.detach()
        weight = torch.exp(sg - mu).clamp(max=is_cap)
        ratio = torch.exp(logp - sg)
        loss = -weight * adv * ratio
    elif variant in ("decoupled", "masked"):
        weight = torch.exp(prox - mu)
        if variant == "masked":
            masked = ((weight < token_mask[0]) | (weight > token_mask[1])).to(logp.dtype)
            weight = weight * (1 - masked)
        else:
            weight = weight.clamp(max=is_cap)
        ratio = torch.exp(logp - prox)
        loss = -weight * torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    else:
        raise ValueError(f"trainer.loss: unknown variant {variant!r}")
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float() if variant != "tis" else torch.zeros_like(ratio)
        stats = {"is_weight": weight.detach(), "clipped": clipped, "masked": masked}
    return loss, stats


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()
