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
  m2po       w = exp(prox - mu), 0 where M2PO's second-moment mask drops the token; r and loss as decoupled

`sg` stops the gradient. With one optimizer step per batch (trainer.minibatches 1) prox = sg(logp), so r = 1
in value and its clip never acts; with several, later updates see r move away from 1 and the clip acts.
Token-level normalisation: an update's loss is the sum over its trained tokens divided by their count (each
micro-batch contributes its sum / the update's total); tokens a mask drops still count in that total.

Each variant is one function of the same signature (`LOSSES`); `Loss` picks it once, by name, with its knobs.

m2po is M2PO: Haizhong Zheng, Jiawei Zhao, Beidi Chen, "Prosperity before Collapse: How Far Can Off-Policy RL
Reach with Stale Data on LLMs?", arXiv:2510.01161 (2025); reference code read: github.com/Infini-AI-Lab/M2PO
(verl/trainer/ppo/core_algos.py) and AReaL's port (github.com/inclusionAI/AReaL, areal/trainer/ppo/actor.py,
`_apply_m2po_masking`, actor.m2_threshold). Implemented: the paper's second moment M2 = mean (log w)^2 over the
update's trained tokens and its Algorithm 1 (drop the token of largest (log w)^2 until the mean over the rest is at
most tau, trainer.m2po_tau, the paper's 0.04), then its objective J = sum_t M_t exp(logp_t - mu_t) A_t / (all
tokens) with the mask M, here w r A with w = exp(prox - mu) untruncated and r = exp(logp - prox).
Where it departs:
  - log w is prox - mu, the proximal policy's log weight, as AReaL computes it, where the paper writes the current
    policy's logp - mu. With trainer.minibatches 1 they are the same values; with several, a later update's mask is
    that of the batch's starting weights, since the current ones are known only in the update's own forwards.
  - the ratio to the proximal policy keeps decoupled PPO's clip (AReaL's form); the paper's objective has no clip.
    With trainer.minibatches 1 r = 1 and the objective is the paper's in value and gradient.
  - Algorithm 1 runs over "the trust-region tokens"; the authors' released code reads these as the tokens whose
    ratio moved with the advantage's sign, and caps them where the paper masks; AReaL, and this, take every trained
    token. Tokens tied with the last one dropped are dropped too (Algorithm 1 drops one of them, arbitrarily).
  - the mask covers the whole update (all its micro-batches, every rank), as the paper's batch statistic does;
    both reference codes compute it per micro-batch. It needs every row's proximal log-prob before the update, so
    with trainer.minibatches 1 the step runs one no-grad forward more (learner/step.py `proximal`): 1.25x the
    learner's CPU time per step for SmolLM2-135M (bench/loss_cost.py; docs/figures.md). With n minibatches that
    pass exists already for the later parts, and m2po adds the first part's 1/n. The mask itself is a sort of the
    update's tokens on the host (0.5 ms for 38,400), the same for every rank and micro-batch, with no collective.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
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


@dataclass(frozen=True)
class Knobs:
    clip_eps: float = 0.2  # trainer.clip_eps
    is_cap: float = 2.0  # trainer.is_cap
    token_mask: tuple[float, float] = (0.5, 2.0)  # trainer.token_mask
    m2po_tau: float = 0.04  # trainer.m2po_tau
    m2_cutoff: float = math.inf  # m2po: this update's (prox - mu)^2 from which a token is dropped; inf: none


# (loss, weight applied, masked 0/1, ratio whose clip acts or None), per token
Terms = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _clip_pg(ratio: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    return -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


def _none(logp, mu, adv, prox, k: Knobs) -> Terms:
    ratio = torch.exp(logp - prox)
    return _clip_pg(ratio, adv, k.clip_eps), torch.ones_like(ratio), torch.zeros_like(logp), ratio


def _ppo(logp, mu, adv, prox, k: Knobs) -> Terms:
    ratio = torch.exp(logp - mu)
    return _clip_pg(ratio, adv, k.clip_eps), torch.ones_like(ratio), torch.zeros_like(logp), ratio


def _tis(logp, mu, adv, prox, k: Knobs) -> Terms:
    sg = logp.detach()
    weight = torch.exp(sg - mu).clamp(max=k.is_cap)
    return -weight * adv * torch.exp(logp - sg), weight, torch.zeros_like(logp), None


def _weighted_clip(weight, masked, logp, adv, prox, k: Knobs) -> Terms:
    """Decoupled PPO's objective with the behaviour weight `weight`."""
    ratio = torch.exp(logp - prox)
    return weight * _clip_pg(ratio, adv, k.clip_eps), weight, masked, ratio


def _decoupled(logp, mu, adv, prox, k: Knobs) -> Terms:
    return _weighted_clip(torch.exp(prox - mu).clamp(max=k.is_cap), torch.zeros_like(logp), logp, adv, prox, k)


def _masked(logp, mu, adv, prox, k: Knobs) -> Terms:
    weight = torch.exp(prox - mu)
    masked = ((weight < k.token_mask[0]) | (weight > k.token_mask[1])).to(logp.dtype)
    return _weighted_clip(weight * (1 - masked), masked, logp, adv, prox, k)


def _m2po(logp, mu, adv, prox, k: Knobs) -> Terms:
    x = prox - mu  # log w; the cutoff lies between the squares of two tokens, so rounding does not move the mask
    masked = (x * x >= k.m2_cutoff).to(logp.dtype)
    return _weighted_clip(torch.exp(x) * (1 - masked), masked, logp, adv, prox, k)


def m2po_cutoff(log_weights: np.ndarray, k: Knobs) -> float:
    """M2PO's Algorithm 1 over an update's trained tokens (their log w = prox - mu): drop the tokens of largest
    (log w)^2 until the mean over the rest is at most tau. Returns a value between the smallest (log w)^2 dropped and
    the largest kept (their mean), so that a token is dropped where its (log w)^2 is at least that; inf: none is."""
    x2 = np.sort(np.square(log_weights.astype(np.float32)))[::-1]  # descending
    suffix_mean = np.cumsum(x2[::-1], dtype=np.float64)[::-1] / np.arange(len(x2), 0, -1)  # of x2[i:]
    under = np.flatnonzero(suffix_mean <= k.m2po_tau)
    dropped = int(under[0]) if len(under) else len(x2)  # every token, where each alone is past tau
    if dropped == 0:
        return math.inf
    kept = float(x2[dropped]) if dropped < len(x2) else 0.0
    return (float(x2[dropped - 1]) + kept) / 2


# trainer.loss -> (per-token terms, the statistic of an update's log weights its mask needs, or None)
LOSSES: dict[str, tuple[Callable[..., Terms], Callable[[np.ndarray, Knobs], float] | None]] = {
    "none": (_none, None), "ppo": (_ppo, None), "tis": (_tis, None), "decoupled": (_decoupled, None),
    "masked": (_masked, None), "m2po": (_m2po, m2po_cutoff),
}


class Loss:
    """One trainer.loss with its knobs: its function picked once, by name. `for_update` gives the loss of one
    optimizer step, which is called per micro-batch: (per-token loss, detached per-token statistics of the
    correction: `is_weight` the weight applied, `clipped` the ratio's clip acted, `masked` a mask dropped it)."""

    def __init__(self, name: str, clip_eps: float = 0.2, is_cap: float = 2.0,
                 token_mask: Sequence[float] = (0.5, 2.0), m2po_tau: float = 0.04):
        if name not in LOSSES:
            raise ValueError(f"trainer.loss: unknown variant {name!r} (known: {', '.join(LOSSES)})")
        self.name = name
        self.terms, self.statistic = LOSSES[name]
        self.knobs = Knobs(clip_eps, is_cap, (token_mask[0], token_mask[1]), m2po_tau)

    @classmethod
    def of(cls, t) -> Loss:
        """From the trainer section of the config (pipeline.config.TrainerConfig)."""
        return cls(t.loss, t.clip_eps, t.is_cap, t.token_mask, t.m2po_tau)

    @property
    def needs_proximal(self) -> bool:
        """Its mask is a statistic of each update's tokens, known before the update's first micro-batch: every row,
        of the first update too, needs its proximal log-probs first (learner/step.py `proximal`)."""
        return self.statistic is not None

    def for_update(self, rows: Sequence, seq_mask: Sequence[float] | None = None) -> Loss:
        """The loss of the optimizer step on `rows` (learner.batching.Row, `prox` set where `needs_proximal`); its
        statistic covers their trained tokens in the samples that `seq_mask` keeps (learner/step.py `seq_kept`)."""
        if self.statistic is None:
            return self
        if any(r.prox is None for r in rows):
            raise RuntimeError(f"trainer.loss {self.name}: rows of an update have no proximal log-probs, which its "
                               "mask needs before the update (learner/step.py `proximal`)")
        logw = [(r.prox - r.behaviour.astype(np.float32))[r.mask > 0] for r in rows]
        kept = [x for x in logw if seq_mask is None or not len(x) or seq_mask[0] <= np.exp(x.mean()) <= seq_mask[1]]
        out = copy.copy(self)
        cutoff = self.statistic(np.concatenate([np.zeros(0, np.float32), *kept]), self.knobs)
        out.knobs = replace(self.knobs, m2_cutoff=cutoff)
        return out

    def __call__(self, logp: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor,
                 prox: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        prox = logp.detach() if prox is None else prox
        loss, weight, masked, ratio = self.terms(logp, mu, adv, prox, self.knobs)
        with torch.no_grad():
            clipped = torch.zeros_like(logp) if ratio is None else ((ratio - 1).abs() > self.knobs.clip_eps).float()
        return loss, {"is_weight": weight.detach(), "clipped": clipped, "masked": masked}


def token_loss(logp: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor, variant: str, clip_eps: float = 0.2,
               is_cap: float = 2.0, prox: torch.Tensor | None = None,
               token_mask: Sequence[float] = (0.5, 2.0)) -> tuple[torch.Tensor, dict]:
    """One call of `variant` outside a step (an update's statistic is not known here: m2po drops nothing)."""
    return Loss(variant, clip_eps, is_cap, token_mask)(logp, mu, adv, prox)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()
