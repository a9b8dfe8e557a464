"""The learner's log-probs of the tokens it trains, computed lean.

A model's logits are [rows, positions, vocabulary]: for Qwen's 151,936 tokens, 1.2 MB per position in fp32.
The step needs one number per completion token, so:

- the model computes logits only from the first position that predicts a completion token (`logits_to_keep`:
  prompts cost no lm_head and no logits);
- `TokenLogprobs` takes the log-softmax at the targets in blocks of positions, in fp32 one block at a time, and
  keeps only the logits the model returned (in its dtype) and one log-sum-exp per position for the backward, which
  it computes block by block too: no fp32 copy of the logits ever exists whole, and autograd keeps none.

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
    """d logp_t / d logits_t = (onehot(target_t) - softmax(logits_t / T)) / T, recomputed from the saved logits
    and log-sum-exps one block of positions at a time."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        temp = None if temperature is None else temperature.float()
        for r, p in _blocks(logits, targets.shape[1]):
            z = _scaled(logits[r, p], temp, r)
            lse[r, p] = torch.logsumexp(z, dim=-1)
            out[r, p] = z.gather(-1, targets[r, p, None]).squeeze(-1) - lse[r, p]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temp = temp
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        temp = ctx.temp
        g = grad.float() if temp is None else grad.float() / temp[:, :, 0]
        out = torch.zeros_like(logits)
        for r, p in _blocks(logits, targets.shape[1]):
            d = _scaled(logits[r, p], temp, r).sub_(lse[r, p, None]).exp_().mul_(-g[r, p, None])  # -softmax * g
            d.scatter_add_(-1, targets[r, p, None], g[r, p, None])
            out[r, p] = d
        return out, None, None


def _scaled(block: torch.Tensor, temp: torch.Tensor | None, rows: slice) -> torch.Tensor:
    """A new fp32 tensor: block / temperature."""
    z = block.float() if block.dtype != torch.float32 else block.clone()
    return z if temp is None else z.div_(temp[rows])


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
