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
    logp = token_logprobs(logits, ids[:, first + 1:], None if batch.get("unit_temperature") else batch["temperature"])
    return F.pad(logp, (first, 0)), logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`: logits [rows, P, V] (P >= T; positions from T on are not
    used), targets [rows, T], temperature [rows, 1, 1] or None for 1 (one fp32 pass fewer) -> [rows, T] in fp32."""
    return TokenLogprobs.apply(logits, targets, temperature)


class TokenLogprobs(torch.autograd.Function):
    """d logp_t / d logits_t = (onehot(target_t) - softmax(logits_t / T)) / T, the softmax recomputed from the saved
    logits one block of positions at a time."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        temp = None if temperature is None else temperature.float()
        for r, p in _blocks(logits, targets.shape[1]):
            logp = _scaled(logits[r, p], temp, r, torch.log_softmax)
            out[r, p] = logp.gather(-1, targets[r, p, None]).squeeze(-1)
        ctx.save_for_backward(logits, targets)
        ctx.temp = temp
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, targets = ctx.saved_tensors
        temp = ctx.temp
        g = grad.float() if temp is None else grad.float() / temp[:, :, 0]
        out = torch.empty_like(logits)
        out[:, targets.shape[1]:].zero_()  # the positions past the targets (the last one) get no gradient
        for r, p in _blocks(logits, targets.shape[1]):
            d = _scaled(logits[r, p], temp, r, torch.softmax)
            d.scatter_add_(-1, targets[r, p, None], torch.full_like(g[r, p, None], -1.0))  # softmax - onehot
            torch.mul(d, g[r, p, None].neg(), out=out[r, p])  # cast to the logits' dtype as it is written
        return out, None, None


def _scaled(block: torch.Tensor, temp: torch.Tensor | None, rows: slice, fn) -> torch.Tensor:
    """fn(block / temperature, dim=-1) in fp32: at temperature 1 one kernel, the input read in its own dtype (a bf16
    block divided by the fp32 temperatures is fp32 too)."""
    if temp is None:
        return fn(block, -1, dtype=torch.float32)
    return fn(block / temp[rows], -1)


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
