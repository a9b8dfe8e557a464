"""GRPO advantages and the policy loss with its off-policy corrections.

Per token, with log-prob `logp` under the weights being trained, behaviour log-prob `mu` (vLLM,
the weights that sampled the token) and the group advantage `A`:

  ppo        r = exp(logp - mu);                 loss = -min(r A, clip(r, 1-eps, 1+eps) A)
  tis        w = min(exp(sg(logp) - mu), C);     loss = -w A exp(logp - sg(logp))     (value -wA, grad -wA dlogp)
  decoupled  w = min(exp(prox - mu), C); r = exp(logp - prox);
                                                 loss = -w min(r A, clip(r, 1-eps, 1+eps) A)

`sg` stops the gradient; `prox` is the proximal policy of decoupled PPO, the weights before this
update. The learner takes one optimizer step per batch, so prox = sg(logp) unless given.
Token-level normalisation: the step's loss is the sum over all completion tokens of the step
divided by their count (each micro-batch contributes its sum / the step's total).
"""

from __future__ import annotations

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
               is_cap: float = 2.0, prox: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token loss (same shape as logp) and detached statistics of the correction."""
    if variant == "ppo":
        ratio = torch.exp(logp - mu)
        loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
        weight = torch.ones_like(ratio)
    elif variant == "tis":
        sg = logp.detach()
        weight = torch.exp(sg - mu).clamp(max=is_cap)
        ratio = torch.exp(logp - sg)
        loss = -weight * adv * ratio
    elif variant == "decoupled":
        prox = logp.detach() if prox is None else prox
        weight = torch.exp(prox - mu).clamp(max=is_cap)
        ratio = torch.exp(logp - prox)
        loss = -weight * torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    else:
        raise ValueError(f"trainer.loss: unknown variant {variant!r}")
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float() if variant != "tis" else torch.zeros_like(ratio)
        stats = {"is_weight": weight.detach(), "clipped": clipped, "behaviour_kl": (mu - logp.detach())}
    return loss, stats


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()
