"""Triton kernels of the learner's log-prob passes on a GPU (learner/logprobs.py takes them for CUDA logits).

One program per (row, position), looping over the vocabulary in blocks: the forward reads the position's logits
once (an online log-sum-exp) and writes two numbers, the backward reads them once more and writes the gradient,
in the logits' dtype, where it is told to (the logits themselves: no second [positions, vocabulary] tensor).
Shapes and strides are arguments, not compiled in: one kernel for every micro-batch. On an H100 at the 0.5B
workload's micro-batch (32 x 257 positions x 151,936, bf16) they move 2.7-2.8 TB/s, where the same passes
compiled by torch.compile with dynamic shapes moved 0.8-0.9 (docs/figures.md, "Learner step").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FORWARD_BLOCK = 2048
BACKWARD_BLOCK = 4096
WARPS = 8


@triton.jit
def _forward(logp_ptr, lse_ptr, x_ptr, tgt_ptr, temp_ptr, positions, vocab, x_row, x_pos, tgt_row, tgt_pos,
             HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)  # row * positions + position
    r = i // positions
    t = i % positions
    base = r.to(tl.int64) * x_row + t.to(tl.int64) * x_pos
    inv = 1.0
    if HAS_TEMP:
        inv = 1.0 / tl.load(temp_ptr + r)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv
        new = tl.maximum(top, x)
        safe = tl.where(new == float("-inf"), 0.0, new)  # a lane past the vocabulary's end so far: its total stays 0
        total = total * tl.exp(top - safe) + tl.exp(x - safe)
        top = new
    m = tl.max(top, 0)
    lse = m + tl.log(tl.sum(total * tl.exp(top - m), 0))
    target = tl.load(tgt_ptr + r.to(tl.int64) * tgt_row + t * tgt_pos)
    x_target = tl.load(x_ptr + base + target).to(tl.float32) * inv
    tl.store(logp_ptr + i, x_target - lse)
    tl.store(lse_ptr + i, lse)


@triton.jit
def _backward(out_ptr, x_ptr, tgt_ptr, lse_ptr, g_ptr, temp_ptr, positions, vocab, x_row, x_pos, out_row, out_pos,
              tgt_row, tgt_pos, HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    r = i // positions
    t = i % positions
    base = r.to(tl.int64) * x_row + t.to(tl.int64) * x_pos
    out_base = r.to(tl.int64) * out_row + t.to(tl.int64) * out_pos
    inv = 1.0
    if HAS_TEMP:
        inv = 1.0 / tl.load(temp_ptr + r)
    lse = tl.load(lse_ptr + i)
    g = tl.load(g_ptr + i)
    target = tl.load(tgt_ptr + r.to(tl.int64) * tgt_row + t * tgt_pos)
    for start in range(0, vocab, BLOCK):  # each element is read before it is written: out may be x
        cols = start + tl.arange(0, BLOCK)
        keep = cols < vocab
        x = tl.load(x_ptr + base + cols, mask=keep, other=0.0).to(tl.float32) * inv
        d = tl.where(cols == target, 1.0, 0.0) - tl.exp(x - lse)
        tl.store(out_ptr + out_base + cols, (d * g).to(out_ptr.dtype.element_ty), mask=keep)


def forward(logits: torch.Tensor, targets: torch.Tensor, temp: torch.Tensor | None):
    """(log-prob at the targets, log-sum-exp) of logits[:, :T] / temp, fp32 [rows, T]: logits [rows, P >= T, V]
    with unit stride over the vocabulary, targets [rows, T], temp fp32 [rows, 1, 1] or None."""
    rows, positions = targets.shape
    logp = torch.empty(rows, positions, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    if logp.numel():
        _forward[(rows * positions,)](logp, lse, logits, targets, _temp(temp, logp), positions, logits.shape[2],
                                      logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
                                      HAS_TEMP=temp is not None, BLOCK=FORWARD_BLOCK, num_warps=WARPS)
    return logp, lse


def backward(out: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
             temp: torch.Tensor | None) -> None:
    """out[:, :T] = (onehot(targets) - softmax(logits / temp)) * g: out shaped as logits, unit stride over the
    vocabulary (it may be logits itself), lse and g contiguous fp32 [rows, T] (g already divided by temp)."""
    rows, positions = targets.shape
    if rows * positions:
        _backward[(rows * positions,)](out, logits, targets, lse, g, _temp(temp, g), positions, logits.shape[2],
                                       logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
                                       targets.stride(0), targets.stride(1), HAS_TEMP=temp is not None,
                                       BLOCK=BACKWARD_BLOCK, num_warps=WARPS)


def _temp(temp: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    return placeholder if temp is None else temp.contiguous()
