"""One learner step: rows -> micro-batches -> loss -> backward -> one optimizer step.

Every rank runs the same number of micro-batches (padded with empty ones) because ZeRO's
collectives must line up; the loss is normalised by the step's total completion tokens over all
ranks, so the gradient is the same however the rows are split. A step whose loss or gradient is not
finite on any rank is skipped (learner.model.FiniteGuard): `stats["skipped"]` is then True, and the
weights and optimizer state are those before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from learner.batching import Row, build_rows, collate, micro_batches, token_logprobs
from learner.loss import masked_sum, token_loss
from pipeline import protocol as P
from pipeline.config import Config


def train_step(engine, groups: list[P.RolloutGroup], cfg: Config, step: int, pad_id: int) -> dict:
    t = cfg.trainer
    rows, stats = build_rows(groups, step, t.scale_rewards)
    for group in engine.optimizer.param_groups:
        group["lr"] = t.lr  # a run-time change of trainer.lr applies from this step
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches = micro_batches(rows, t.micro_batch_tokens)
    mine = batches[rank::world]
    n_steps = max(1, -(-len(batches) // world))
    total_tokens = max(1, int(sum(r.mask.sum() for r in rows)))  # the trained tokens (mask 1)
    sums = {"loss": 0.0, "is_weight": 0.0, "clipped": 0.0, "behaviour_kl": 0.0}
    device = engine.device
    for i in range(n_steps):
        mb = mine[i] if i < len(mine) else None
        engine.set_gradient_accumulation_boundary(i == n_steps - 1)
        batch = collate(mb or [_empty_row(rows, groups)], pad_id, device)
        if mb is None:
            batch["mask"].zero_()  # padding micro-batch: zero gradient, keeps collectives in step
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp = token_logprobs(logits, batch["input_ids"], batch["temperature"])
        loss_tok, st = token_loss(logp, batch["mu"], batch["adv"], t.loss, t.clip_eps, t.is_cap)
        loss = masked_sum(loss_tok, batch["mask"]) / total_tokens
        engine.finite_guard.add_loss(loss)
        engine.backward(loss, scale_wrt_gas=False)
        if i == n_steps - 1:
            grad_norm = _grad_norm(engine, t.zero_stage)
            finite = engine.finite_guard.step_is_finite(device)
            engine.finite_guard.optimizer.skip = not finite
        try:
            engine.step()
        finally:
            engine.finite_guard.optimizer.skip = False
        sums["loss"] += float(loss.detach())
        for k in ("is_weight", "clipped", "behaviour_kl"):
            sums[k] += float(masked_sum(st[k], batch["mask"]))
    stats.update({
        "skipped": not finite,
        "loss": sums["loss"], "lr": t.lr, "micro_batches": len(batches),
        "grad_norm": grad_norm if grad_norm >= 0 or not finite else float(engine.get_global_grad_norm() or 0.0),
        "tokens/trained": total_tokens if rows else 0,
        "correction/is_weight_mean": sums["is_weight"] / total_tokens,
        "correction/clip_frac": sums["clipped"] / total_tokens,
        "correction/behaviour_kl": sums["behaviour_kl"] / total_tokens,
    })
    return stats


def _grad_norm(engine, zero_stage: int) -> float:
    """Gradient norm before clipping. ZeRO 1-3 optimizers compute it in step(); without ZeRO, DeepSpeed
    clips but does not keep the norm, so it is computed here."""
    if zero_stage > 0:
        return -1.0  # read after the step
    grads = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def _empty_row(rows: list[Row], groups: list[P.RolloutGroup]) -> Row:
    import numpy as np

    if rows:
        r = rows[0]
        return Row(r.prompt, r.completion, r.behaviour, r.mask, 0.0, r.temperature)
    prompt = P.unpack_ints(groups[0].prompt_ids)
    return Row(prompt, np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.uint8), 0.0,
               1.0)
