"""The learner's log-probs of the tokens it trains, computed lean.

A model's logits are [rows, positions, vocabulary]: for Qwen's 151,936 tokens, 1.2 MB per position in fp32.
The step needs one number per completion token, so:

- the model computes logits only from the first position that predicts a completion token (`logits_to_keep`:
  prompts cost no lm_head and no logits);
- `TokenLogprobs` keeps only the logits the model returned (in its dtype) for the backward, which recomputes the
  softmax from them: no fp32 copy of the logits ever exists whole, and autograd keeps none;
- the backward writes the gradient into the logits' own storage when the caller says it reads them no more
  (`in_place`; `forward_logprobs` does): one [rows, positions, vocabulary] tensor fewer at the step's peak.

On a GPU each pass is one Triton kernel over the whole micro-batch (learner/kernels.py): the forward reads the
logits once and keeps a log-sum-exp per position, the backward reads them once more and writes the gradient. Elsewhere
(the CPU) the passes go block by block of positions in eager torch: at temperature 1 one kernel per pass that reads
the logits in their dtype and computes in fp32 (`log_softmax` / `softmax` with dtype float32).

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
    log-probs before it are 0. A backward through the log-probs turns the logits into their gradient: read them
    before it."""
    ids = batch["input_ids"]
    first = batch.get("first", 0)
    kwargs = {"input_ids": ids, "attention_mask": batch["attention_mask"]}
    if first > 0 and _keeps_logits(model):
        logits = model(**kwargs, logits_to_keep=ids.shape[1] - first).logits  # positions first .. L-1
    else:
        logits = model(**kwargs).logits[:, first:]
    temperature = None if batch.get("unit_temperature") else batch["temperature"]
    logp = token_logprobs(logits, ids[:, first + 1:], temperature, in_place=True)
    return F.pad(logp, (first, 0)), logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | None,
                   in_place: bool = False) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`: logits [rows, P, V] (P >= T; positions from T on are not
    used), targets [rows, T], temperature [rows, 1, 1] or None for 1 (one fp32 pass fewer) -> [rows, T] in fp32.
    `in_place`: the backward writes the logits' gradient into the logits (the caller reads them no more)."""
    return TokenLogprobs.apply(logits, targets, temperature, in_place)


class TokenLogprobs(torch.autograd.Function):
    """d logp_t / d logits_t = (onehot(target_t) - softmax(logits_t / T)) / T, the softmax recomputed from the saved
    logits."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, in_place):
        temp = None if temperature is None else temperature.float()
        lse = None  # the kernels' backward starts from the forward's log-sum-exp
        if _on_gpu(logits):
            from learner import kernels

            out, lse = kernels.forward(logits, targets, temp)
        else:
            out = eager_forward(logits, targets, temp)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temp, ctx.in_place = temp, in_place
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        temp = ctx.temp
        g = grad.float() if temp is None else grad.float() / temp[:, :, 0]
        out = logits if ctx.in_place else torch.empty_like(logits)
        if lse is not None:
            from learner import kernels

            kernels.backward(out, logits, targets, lse, g.contiguous(), temp)
        else:
            eager_backward(out, logits, targets, g, temp)
        out[:, targets.shape[1]:].zero_()  # the positions past the targets (the last one) get no gradient
        return out, None, None, None


def eager_forward(logits: torch.Tensor, targets: torch.Tensor, temp: torch.Tensor | None) -> torch.Tensor:
    """The forward off the GPU: log softmax(logits / temp) at the targets, block by block of positions, fp32."""
    out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    for r, p in _blocks(logits, targets.shape[1]):
        logp = _scaled(logits[r, p], _rows(temp, r), torch.log_softmax)
        out[r, p] = logp.gather(-1, targets[r, p, None]).squeeze(-1)
    return out


def eager_backward(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, g: torch.Tensor,
                   temp: torch.Tensor | None) -> None:
    """The backward off the GPU: out[:, :T] = (onehot(targets) - softmax(logits / temp)) * g (g already divided by
    temp), block by block; each block is read whole before it is written, so out may be logits."""
    for r, p in _blocks(logits, targets.shape[1]):
        d = _scaled(logits[r, p], _rows(temp, r), torch.softmax)
        d.scatter_add_(-1, targets[r, p, None], torch.full_like(g[r, p, None], -1.0))  # softmax - onehot
        torch.mul(d, g[r, p, None].neg(), out=out[r, p])  # cast to the logits' dtype as it is written


def _on_gpu(logits: torch.Tensor) -> bool:
    """Whether the Triton kernels take these logits: on a CUDA device, unit stride over the vocabulary."""
    return logits.is_cuda and logits.stride(-1) == 1 and _has_triton()


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


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
    model = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes it through
    return _forward_takes_logits_to_keep(type(model))  # type: ignore[arg-type]  # mypy#11470: a class is hashable


@functools.cache
def _forward_takes_logits_to_keep(cls: type[torch.nn.Module]) -> bool:
    """Once per model class, not per micro-batch: the step's host time is what bounds it."""
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
