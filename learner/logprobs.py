"""The learner's log-probs of the tokens it trains, computed lean.

A model's logits are [rows, positions, vocabulary]: for Qwen's 151,936 tokens, 1.2 MB per position in fp32.
The step needs one number per completion token, so:

- the model computes logits only from the first position that predicts a completion token (`logits_to_keep`:
  prompts cost no lm_head and no logits);
- `TokenLogprobs` takes the log-softmax at the targets in blocks of positions, one block at a time, and keeps only
  the logits the model returned (in its dtype) for the backward, which recomputes the softmax block by block: no
  fp32 copy of the logits ever exists whole, and autograd keeps none. At temperature 1 each pass over a block is one
  kernel that reads the model's bf16 logits and computes in fp32 (`log_softmax` / `softmax` with dtype float32),
  and the backward writes its bf16 gradient directly: 2 passes over the logits a micro-batch instead of 11 (the
  0.5B shape's 65k completion tokens x 151,936 entries: 10G logits).

With `trainer.compile` the passes are compiled instead (`compiled=True`): the forward is one reduction per block
that reads the logits once and writes a log-sum-exp and a log-prob per position, and the backward one pointwise
kernel that writes the bf16 gradient into place: no [positions, vocabulary] fp32 tensor is ever written.

The values are those of `log_softmax(logits.float() / temperature)` at the targets.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**27  # fp32 logits worked on at once: 512 MB (883 positions of a 151,936-token vocabulary)


def forward_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each next token [rows, L-1], the logits the model returned [rows, L-first, V]) for a collated
    micro-batch. Logits start at position `batch["first"]` (the first that predicts a completion token); the
    log-probs before it are 0."""
    ids = batch["input_ids"]
    first = batch.get("first", 0)
    kwargs = {"input_ids": ids, "attention_mask": batch["attention_mask"]}
    if first > 0 and _keeps_logits(model):
        logits = model(**kwargs, logits_to_keep=ids.shape[1] - first).logits  # positions first .. L-1
    else:
        logits = model(**kwargs).logits[:, first:]
    temperature = None if batch.get("unit_temperature") else batch["temperature"]
    logp = token_logprobs(logits, ids[:, first + 1:], temperature, getattr(model, "compiled_logprobs", False))
    return F.pad(logp, (first, 0)), logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | None,
                   compiled: bool = False) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`: logits [rows, P, V] (P >= T; positions from T on are not
    used), targets [rows, T], temperature [rows, 1, 1] or None for 1 (one fp32 pass fewer) -> [rows, T] in fp32.
    `compiled`: the passes compiled with torch.compile (fused, no fp32 block written)."""
    return TokenLogprobs.apply(logits, targets, temperature, compiled)


class TokenLogprobs(torch.autograd.Function):
    """d logp_t / d logits_t = (onehot(target_t) - softmax(logits_t / T)) / T, the softmax recomputed from the saved
    logits one block of positions at a time."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, compiled):
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out) if compiled else None  # the compiled backward starts from it
        temp = None if temperature is None else temperature.float()
        for r, p in _blocks(logits, targets.shape[1]):
            if compiled:
                out[r, p], lse[r, p] = _compiled(_fused_forward)(logits[r, p], targets[r, p], _rows(temp, r))
                continue
            logp = _scaled(logits[r, p], _rows(temp, r), torch.log_softmax)
            out[r, p] = logp.gather(-1, targets[r, p, None]).squeeze(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temp = temp
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        temp = ctx.temp
        g = grad.float() if temp is None else grad.float() / temp[:, :, 0]
        out = torch.empty_like(logits)
        out[:, targets.shape[1]:].zero_()  # the positions past the targets (the last one) get no gradient
        for r, p in _blocks(logits, targets.shape[1]):
            if lse is not None:
                _compiled(_fused_backward)(out[r, p], logits[r, p], targets[r, p], lse[r, p], g[r, p], _rows(temp, r))
                continue
            d = _scaled(logits[r, p], _rows(temp, r), torch.softmax)
            d.scatter_add_(-1, targets[r, p, None], torch.full_like(g[r, p, None], -1.0))  # softmax - onehot
            torch.mul(d, g[r, p, None].neg(), out=out[r, p])  # cast to the logits' dtype as it is written
        return out, None, None, None


def _fused_forward(block, targets, temp):
    """(log-prob at the targets, log-sum-exp) of block / temp, in fp32: one reduction over the vocabulary."""
    x = block.float() if temp is None else block.float() / temp
    lse = torch.logsumexp(x, -1)
    return x.gather(-1, targets[..., None]).squeeze(-1) - lse, lse


def _fused_backward(out, block, targets, lse, g, temp):
    """out = (onehot(targets) - softmax(block / temp)) * g, written in out's dtype: one pointwise pass."""
    x = block.float() if temp is None else block.float() / temp
    onehot = torch.arange(x.shape[-1], device=x.device) == targets[..., None]
    out.copy_((onehot.float() - torch.exp(x - lse[..., None])) * g[..., None])


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _rows(temp: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The temperatures of a block's rows (None: all 1)."""
    return None if temp is None else temp[rows]


def _scaled(block: torch.Tensor, temp: torch.Tensor | None, fn) -> torch.Tensor:
    """fn(block / temp, dim=-1) in fp32 (temp: the block's rows' temperatures): at temperature 1 one kernel, the
    input read in its own dtype (a bf16 block divided by the fp32 temperatures is fp32 too)."""
    if temp is None:
        return fn(block, -1, dtype=torch.float32)
    return fn(block / temp, -1)


def _blocks(logits: torch.Tensor, positions: int):
    """(rows, positions) slices covering [rows, :positions] with at most CHUNK_ELEMENTS logits each."""
    rows, vocab = logits.shape[0], logits.shape[2]
    per_row = positions * vocab
    if per_row <= CHUNK_ELEMENTS:
        step = max(1, CHUNK_ELEMENTS // max(1, per_row))
        for i in range(0, rows, step):
            yield slice(i, i + step), slice(0, positions)
        return
    step = max(1, CHUNK_ELEMENTS // vocab)
    for i in range(rows):
        for j in range(0, positions, step):
            yield slice(i, i + 1), slice(j, min(j + step, positions))


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do)."""
    return _forward_takes_logits_to_keep(type(getattr(model, "module", model)))  # a DeepSpeed engine wraps the model


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:
    """Once per model class, not per micro-batch: the step's host time is what bounds it."""
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
