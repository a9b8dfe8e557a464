"""What a step says about the run's health: the train-inference mismatch by lag, the importance weights and what
the corrections left out, the entropy of the trained tokens.

Per trained token, with x = prox - mu (the learner's log-prob before the batch's first update minus vLLM's):

    mismatch/kl            k3 = exp(x) - 1 - x >= 0, averaged: an estimate of KL(behaviour || learner). Split by
                           the sample's lag: mismatch/kl_lag{j}. At lag 0 both sides hold the same weights version,
                           so what is left is the engines' numerical difference, the train-inference mismatch.
    correction/is_weight_{mean,max,p50,p90,p99}   exp(x), before truncation or masks; _mean also by lag
    correction/weight_mean the weight the loss applied (truncated, masked)
    correction/token_masked, correction/seq_masked   the fraction of trained tokens the token mask (masked, and
                           m2po's second-moment mask) and the geometric sequence mask (trainer.seq_mask) left out
    correction/clip_frac   the ratio's clip acted (ppo; decoupled, masked and m2po once an update moved the weights)
    entropy/mean           of the learner's distribution at the trained tokens (at the temperature sampled; at most
                           ENTROPY_TOKENS of them per micro-batch)
    kl/reference           k3 of KL(learner || the frozen initial model), with trainer.kl_coef > 0

Sums are all-reduced over the learner's ranks; the quantiles come from rank 0's tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SUMS = ("tokens", "kl", "is_weight", "weight", "token_masked", "seq_masked", "clipped", "entropy", "entropy_tokens",
        "ref_kl")
ENTROPY_TOKENS = 512  # per micro-batch, evenly spaced: the entropy needs the whole distribution at each (the
# 0.5B shape's 151,936 entries at every trained token made the learner step 20 % slower)


class StepHealth:
    def __init__(self, max_lag: int):
        self.max_lag = max_lag
        self.sums: torch.Tensor | None = None  # on the learner's device: no synchronisation per micro-batch
        self.weights: list[tuple[torch.Tensor, torch.Tensor]] = []  # (exp(x), mask) of this rank's micro-batches

    def add(self, batch: dict, logits: torch.Tensor, prox: torch.Tensor, stats: dict, seq_kept: torch.Tensor) -> None:
        """One micro-batch: `batch["mask"]` the trained tokens, `seq_kept` [rows] 0 for a sample the sequence
        mask left out."""
        with torch.no_grad():
            mask = batch["mask"]
            x = ((prox - batch["mu"]) * mask).double()  # float64: at lag 0 on CPU x is about 1e-8, k3 about 1e-16
            k3 = (torch.exp(x) - 1 - x) * mask
            w = torch.exp(x)
            row_tokens = mask.sum(1)
            values = {
                "tokens": mask.sum(), "kl": k3.sum(), "is_weight": (w * mask).sum(),
                "weight": (stats["is_weight"] * mask * seq_kept[:, None]).sum(),
                "token_masked": (stats["masked"] * mask).sum(), "seq_masked": (row_tokens * (1 - seq_kept)).sum(),
                "clipped": (stats["clipped"] * mask).sum(), **entropy_sum(logits, batch, mask),
                "ref_kl": (stats.get("ref_kl", torch.zeros_like(mask)) * mask).sum(),
            }
            by_lag = torch.zeros(3, self.max_lag + 1, dtype=torch.float64, device=mask.device)
            lag = batch["lag"].clamp(max=self.max_lag)
            for i, v in enumerate((row_tokens, k3.sum(1), (w * mask).sum(1))):
                by_lag[i].index_add_(0, lag, v.double())
            add = torch.cat([torch.stack([values[k].double() for k in SUMS]), by_lag.flatten()])
            self.sums = add if self.sums is None else self.sums + add
            self.weights.append((w.float(), mask))  # the trained tokens' are picked in summary (a host sync)

    def summary(self) -> dict:
        sums = self.sums if self.sums is not None else torch.zeros(len(SUMS) + 3 * (self.max_lag + 1),
                                                                    dtype=torch.float64)
        if dist.is_initialized():
            sums = sums.to("cuda" if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(sums)
        sums = sums.cpu()
        s = dict(zip(SUMS, sums[:len(SUMS)].tolist(), strict=True))
        by_lag = sums[len(SUMS):].view(3, self.max_lag + 1)
        n = max(1.0, s["tokens"])
        out = {
            "mismatch/kl": s["kl"] / n, "correction/is_weight_mean": s["is_weight"] / n,
            "correction/weight_mean": s["weight"] / n, "correction/token_masked": s["token_masked"] / n,
            "correction/seq_masked": s["seq_masked"] / n, "correction/clip_frac": s["clipped"] / n,
            "entropy/mean": s["entropy"] / max(1.0, s["entropy_tokens"]), "kl/reference": s["ref_kl"] / n,
        }
        for j in range(self.max_lag + 1):
            tokens = float(by_lag[0, j])
            if tokens:
                out[f"mismatch/kl_lag{j}"] = float(by_lag[1, j]) / tokens
                out[f"correction/is_weight_mean_lag{j}"] = float(by_lag[2, j]) / tokens
        weights = torch.cat([w[m > 0] for w, m in self.weights]).cpu() if self.weights else torch.ones(1)
        weights = weights if len(weights) else torch.ones(1)
        q = torch.quantile(weights[:2**24], torch.tensor([0.5, 0.9, 0.99])).tolist()
        out.update({"correction/is_weight_max": float(weights.max()), "correction/is_weight_p50": q[0],
                    "correction/is_weight_p90": q[1], "correction/is_weight_p99": q[2]})
        return out


def entropy_sum(logits: torch.Tensor, batch: dict, mask: torch.Tensor) -> dict:
    """The entropy of softmax(logits / temperature) summed over the trained positions `batch["entropy_at"]` (at
    most ENTROPY_TOKENS, chosen on the host by collate; `entropy_positions(mask)` without it), and their count.
    Logits start at position `batch["first"]`."""
    rows, cols = batch["entropy_at"] if "entropy_at" in batch else entropy_positions(mask)
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    if not len(rows):
        return {"entropy": zero, "entropy_tokens": zero}
    z = logits[rows, cols - batch.get("first", 0)].float() / batch["temperature"][rows, 0]
    logp = torch.log_softmax(z, dim=-1)
    kept = mask[rows, cols].double()  # 0 where the step zeroed the mask (a padding micro-batch)
    return {"entropy": (-(logp.exp() * logp).sum(-1).double() * kept).sum(), "entropy_tokens": kept.sum()}


def entropy_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of at most ENTROPY_TOKENS trained positions of `mask`, evenly spaced."""
    rows, cols = torch.nonzero(mask, as_tuple=True)
    if len(rows) > ENTROPY_TOKENS:
        pick = torch.linspace(0, len(rows) - 1, ENTROPY_TOKENS, device=rows.device).long()
        rows, cols = rows[pick], cols[pick]
    return rows, cols
