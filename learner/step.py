"""One learner step: rows -> mini-batches -> micro-batches -> loss -> backward -> one optimizer step per mini-batch.

Micro-batches hold `trainer.micro_batch_tokens` tokens (rows x padded length), or with 0 as many as fit in the GPU
memory free at the step (`token_budget`, from the memory per token that the largest micro-batch took so far).

A batch's rows are split into `trainer.minibatches` parts in an order fixed by the step (the same on every
rank), one optimizer step each. Before the first, when there are several, the proximal log-probs of the rows
of the later parts are computed with the batch's starting weights (a no-grad forward, each rank its own
micro-batches, then shared with every rank): decoupled, masked and m2po measure each update against them. A loss
whose mask is a statistic of each update's tokens (m2po, `Loss.needs_proximal`) has them computed for the first
part's rows too, so that every rank knows the whole update's statistic before its first micro-batch. Every rank
runs the same number of micro-batches per part (padded with empty ones) because ZeRO's collectives must line up;
a part's loss is normalised by its trained tokens over all ranks and each rank's backward scaled by the rank
count (DeepSpeed averages gradients over ranks), so the gradient, its norm and its clip are the same however the
rows are split and over however many ranks. The run-time knobs (`trainer.lr`) come from the batch's snapshot.
A part whose loss or gradient is not finite on any rank changes nothing (learner.model.FiniteGuard);
`stats["skipped"]` is True when no part updated the weights. learner/health.py turns the step's tokens into its
health metrics.
"""

from __future__ import annotations

import random
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from learner.batching import Row, build_rows, collate, micro_batches, padded
from learner.health import StepHealth
from learner.logprobs import forward_logprobs
from learner.loss import Loss, masked_sum
from learner.model import Extras, free_gpu_bytes, input_embeddings
from pipeline import protocol as P
from pipeline.config import Config
from pipeline.runtime_knobs import runtime_values


class Ahead(Protocol):
    """Proximal log-probs computed before the step (learner/early.py's EarlyProximal)."""

    def fill(self, rows: list[Row], step: int) -> int:
        """Set the `prox` of the rows computed at this step's weights; returns how many."""
        ...


def train_step(engine, extras: Extras, groups: list[P.RolloutGroup], cfg: Config, step: int, pad_id: int,
               knobs: dict | None = None, early: Ahead | None = None) -> dict:
    """`extras`: what build_engine made beside the engine. `knobs`: the run-time knobs the batch was built under
    (`Hub.take_batch`, the same on every rank); None: as `cfg` holds them now (one read). `early`: the proximal
    log-probs of rows computed while the learner waited for the batch (learner/early.py), at this step's weights."""
    t = cfg.trainer
    knobs = knobs or runtime_values(cfg)
    rows, stats = build_rows(groups, step, t.scale_rewards, (cfg.sampling.max_tokens, t.overlong_buffer,
                                                            t.overlong_penalty))
    lr = knobs["trainer.lr"]
    for group in engine.optimizer.param_groups:
        group["lr"] = lr  # a run-time change of trainer.lr applies from the batch it came before
    parts = split(rows, t.minibatches, step)
    budget = token_budget(engine, t.micro_batch_tokens, extras.bytes_per_token)
    memory = MemoryWatch(extras)
    loss_fn = Loss.of(t)
    measured = parts if loss_fn.needs_proximal else parts[1:]  # the parts measured against the proximal policy
    measured_rows = [r for part in measured for r in part]
    ahead = early.fill(measured_rows, step) if early is not None else 0
    if left := [r for r in measured_rows if r.prox is None]:
        proximal(engine, left, budget, pad_id, rows, groups)
    health = StepHealth(max((r.lag for r in rows), default=0))  # the lags present (<= k), whatever k is
    losses, norms, applied = [], [], 0
    try:
        for i, part in enumerate(parts):
            loss, grad_norm, finite = _update(engine, extras, part, cfg, loss_fn.for_update(part, t.seq_mask), budget,
                                              pad_id, rows, groups, health, memory,
                                              needs_prox=i > 0 or loss_fn.needs_proximal)
            losses.append(loss)
            norms.append(grad_norm)
            applied += finite
    except torch.OutOfMemoryError as e:
        raise torch.OutOfMemoryError(f"the learner ran out of GPU memory in a micro-batch of up to {budget} tokens "
                                     f"(trainer.micro_batch_tokens={t.micro_batch_tokens}): lower it. {e}") from e
    stats.update(health.summary())
    stats["learner/micro_batch_tokens"] = budget
    if early is not None:
        stats["learner/early_rows"] = ahead  # rows whose proximal log-probs were computed while the learner waited
    if memory.on:
        stats["learner/peak_gpu_gib"] = memory.peak / 2**30
    stats.update({
        "skipped": applied == 0, "updates": applied, "loss": _all_ranks_mean(losses), "lr": lr,
        "grad_norm": float(np.mean(norms)), "tokens/trained": int(sum(r.mask.sum() for r in rows)),
    })
    return stats


def split(rows: list[Row], n: int, step: int) -> list[list[Row]]:
    """`n` parts of nearly equal size, in an order drawn from the step (every rank draws the same)."""
    if n <= 1 or len(rows) < 2:
        return [rows]
    order = list(range(len(rows)))
    random.Random(step).shuffle(order)
    parts = [[rows[i] for i in order[j::n]] for j in range(min(n, len(rows)))]
    return [p for p in parts if p]


AUTO_FIRST_TOKENS = 8192  # micro_batch_tokens 0: the budget of the first step, which measures the memory per token
AUTO_SHARE = 0.8  # of the memory free at a step that its largest micro-batch may take


def token_budget(engine, configured: int, per_token: float) -> int:
    """The micro-batch token budget of this step: `configured`, or with 0 the tokens that fit in AUTO_SHARE of the
    GPU memory free now (`free_gpu_bytes`: within trainer.gpu_memory_gb's cap), at the bytes per token the largest
    micro-batch took so far (`per_token`, 0: none yet). Every rank takes the smallest rank's budget (the ranks must run
    the same micro-batches)."""
    if configured > 0:
        return configured
    if not torch.cuda.is_available():
        return AUTO_FIRST_TOKENS
    free = free_gpu_bytes()
    budget = max(AUTO_FIRST_TOKENS // 8, int(AUTO_SHARE * free / per_token)) if per_token > 0 else AUTO_FIRST_TOKENS
    smallest = torch.tensor([budget], device=engine.device)
    if _world() > 1:  # every rank, every step: the same collectives
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())


class MemoryWatch:
    """Bytes of GPU memory per token that a micro-batch's forward and backward take above the memory held before
    it (activations, logits, gradients), the largest seen: `extras.bytes_per_token`, which `token_budget` divides
    the free memory by."""

    def __init__(self, extras: Extras):
        self.extras = extras
        self.on = torch.cuda.is_available()
        self.peak = 0  # the most memory allocated during the step's forwards and backwards

    def start(self) -> None:
        if self.on:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

    def end(self, tokens: int) -> None:
        if self.on and tokens:
            peak = torch.cuda.max_memory_allocated()
            self.peak = max(self.peak, peak)
            self.extras.bytes_per_token = max(self.extras.bytes_per_token, (peak - self.base) / tokens)


def proximal(engine, rows: list[Row], budget: int, pad_id: int, all_rows: list[Row], groups) -> None:
    """Set each row's `prox`: its completion's log-probs under the current weights (no gradient), on every rank.
    Each rank computes those of its own micro-batches; one all-reduce of a flat buffer of every row's completion
    tokens (each filled by the one rank that computed it) gives every rank all of them, since the later parts are
    packed and dealt to the ranks anew."""
    offsets = np.cumsum([0] + [len(r.completion) for r in rows])
    flat = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=engine.device)
    index = {id(r): i for i, r in enumerate(rows)}
    for batch, mb in _micro_batches(rows, budget, pad_id, all_rows, groups, engine.device):
        with torch.no_grad():
            logp = forward_logprobs(engine, batch)[0]
        for i, r in enumerate(mb or []):
            p, j = len(r.prompt), index[id(r)]
            flat[offsets[j]:offsets[j + 1]] = logp[i, p - 1:p + len(r.completion) - 1]
    if _world() > 1:
        dist.all_reduce(flat)
    host = flat.cpu().numpy()
    for j, r in enumerate(rows):
        r.prox = host[offsets[j]:offsets[j + 1]].copy()


def _micro_batches(rows, budget, pad_id, all_rows, groups, device):
    """This rank's micro-batches of `rows` as (tensors, rows), padded with empty ones to the count every rank runs
    (rows None: a padding micro-batch, mask all 0). A micro-batch of one row gets a masked copy of it beside it where
    two fit the budget: trainer.compile's layers are compiled for two rows and more, and a lone row (size 1, which
    torch specialises) compiled them all again in the middle of a run (docs/figures.md)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches = micro_batches(rows, budget)
    mine = batches[rank::world]
    for i in range(max(1, -(-len(batches) // world))):
        mb = mine[i] if i < len(mine) else None
        part = mb or [_empty_row(all_rows, groups)]
        if len(part) == 1 and 2 * padded(part[0].length) <= budget:
            part = [*part, _empty_row(part, groups)]
        batch = collate(part, pad_id, device)
        batch["mask"][len(mb or []):].zero_()  # the copies and padding micro-batches train nothing
        yield batch, mb


def _update(engine, extras: Extras, part: list[Row], cfg: Config, loss_fn: Loss, budget: int, pad_id: int, rows,
            groups, health: StepHealth, memory: MemoryWatch, needs_prox: bool = False):
    """One optimizer step on `part` with the loss of this update (`Loss.for_update`): (this rank's share of its
    loss as a device value, gradient norm, whether it was applied). `needs_prox`: a part measured against the
    proximal log-probs of the batch's starting weights, which each of its rows must have (the current weights would
    silently turn decoupled and masked into truncated IS, and m2po's mask would not be its update's).

    Every rank's loss is divided by the trained tokens of the whole part (all ranks), so the sum over ranks is the
    part's loss; DeepSpeed averages the gradients over the ranks, so each rank's backward is scaled by their number:
    the gradient, its norm and its clip are the same with any rank count."""
    t = cfg.trainer
    world = _world()
    total_tokens = max(1, int(sum(r.mask.sum() for r in part)))  # the trained tokens (mask 1)
    batches = list(_micro_batches(part, budget, pad_id, rows, groups, engine.device))
    total_loss = torch.zeros((), device=engine.device)  # read once, at the end: no host sync per micro-batch
    for i, (batch, mb) in enumerate(batches):
        last = i == len(batches) - 1
        if needs_prox and mb and "prox" not in batch:
            raise RuntimeError(f"trainer.minibatches: {sum(r.prox is None for r in mb)} of {len(mb)} rows of a "
                               "micro-batch have no proximal log-probs; decoupled, masked and m2po would measure "
                               "them against the current weights")
        memory.start()
        engine.set_gradient_accumulation_boundary(last)
        logp, logits = forward_logprobs(engine, batch)
        prox = batch.get("prox", logp.detach())
        loss_tok, st = loss_fn(logp, batch["mu"], batch["adv"], prox)
        if extras.reference is not None:  # trainer.kl_coef: k3 of KL(learner || initial model), per token
            with torch.no_grad():
                ref = forward_logprobs(extras.reference, batch)[0]
            ref_kl = torch.exp(ref - logp) - (ref - logp) - 1
            loss_tok = loss_tok + t.kl_coef * ref_kl
            st["ref_kl"] = ref_kl.detach()
        kept = seq_kept(prox, batch, t.seq_mask)
        loss = masked_sum(loss_tok, batch["mask"] * kept[:, None]) / total_tokens
        health.add(batch, logits, prox, st, kept)
        extras.guard.add_loss(loss)
        engine.backward(loss * world if world > 1 else loss, scale_wrt_gas=False)
        memory.end(batch["input_ids"].numel())
        if last:
            finite = extras.guard.step_is_finite(engine.device)
            grad_norm = _grad_norm(extras)
            extras.guard.optimizer.skip = not finite
        try:
            engine.step()
        finally:
            extras.guard.optimizer.skip = False
        total_loss += loss.detach().float()
    if grad_norm < 0 and finite:
        grad_norm = float(engine.get_global_grad_norm() or 0.0)
    return total_loss, grad_norm, finite


def _world() -> int:
    """The learner's ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_ranks_mean(losses: list[torch.Tensor]) -> float:
    """The mean over the parts of each part's loss, summed over the ranks (each holds its share)."""
    total = torch.stack(losses)
    if _world() > 1:
        dist.all_reduce(total)
    return float(total.mean())


def seq_kept(prox: torch.Tensor, batch: dict, bounds: list[float] | None) -> torch.Tensor:
    """[rows] 1.0 for a sample the geometric sequence mask keeps: exp(mean over its trained tokens of prox - mu)
    within `bounds` (None: every sample)."""
    mask = batch["mask"]
    if bounds is None:
        return torch.ones(mask.shape[0], device=mask.device)
    with torch.no_grad():
        mean = ((prox - batch["mu"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
        g = torch.exp(mean)
        return ((g >= bounds[0]) & (g <= bounds[1])).to(mask.dtype)


def _grad_norm(extras: Extras) -> float:
    """Gradient norm before clipping. Without ZeRO the finite guard measured it (FiniteGuard.grad_norm; MixedAdamW
    clips by it). ZeRO 1-3 optimizers compute it in step(): -1, read after the step."""
    norm = extras.guard.grad_norm
    return -1.0 if norm is None else float(norm)


def _empty_row(rows: list[Row], groups: list[P.RolloutGroup]) -> Row:
    if rows:
        r = rows[0]
        return Row(r.prompt, r.completion, r.behaviour, r.mask, 0.0, r.temperature, 0, r.prox)
    prompt = P.unpack_ints(groups[0].prompt_ids)
    return Row(prompt, np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.uint8), 0.0,
               1.0)


def warm_up(engine, cfg: Config, pad_id: int) -> bool:
    """trainer.compile: compile the step's graphs on a made-up micro-batch while the first batch is generated, so the
    first step does not (a cold machine compiled SmolLM2's for 28 s after a wait of 80 s for its batch; a QLoRA
    learner's for about 72 s). The passes a step makes: one without gradients (proximal and reference log-probs),
    then one with them, whose graph AOTAutograd compiles with its backward. The backward runs once too, for the
    log-prob passes' Triton kernels (learner/kernels.py), which compile at their first call on a GPU; it asks for the
    gradient of the embeddings' output alone, so no weight's gradient is made: the weights, their gradients and the
    optimizer (DeepSpeed's hooks included) are as before. Under gradient checkpointing it is left to the first step
    (its recompute makes the weights' gradients whatever is asked). Returns whether it ran."""
    if not cfg.trainer.compile:
        return False
    model = engine.module
    rows = [Row(np.full(n, 5, dtype=np.int64), np.full(8, 6, dtype=np.int64), np.zeros(8, dtype=np.float32),
                np.ones(8, dtype=np.uint8), 0.0, 1.0) for n in (16, 24)]  # two lengths: padded, as most are
    batch = collate(rows, pad_id, engine.device)
    with torch.no_grad():
        forward_logprobs(model, batch)
    embeddings = input_embeddings(model)
    if embeddings is None or cfg.trainer.gradient_checkpointing:
        return True
    inputs: list[torch.Tensor] = []
    hook = embeddings.register_forward_hook(lambda module, args, output: inputs.append(output))
    try:
        logp = forward_logprobs(model, batch)[0]
    finally:
        hook.remove()
    if inputs[0].requires_grad:
        torch.autograd.grad(logp.sum(), inputs[0])
    return True
