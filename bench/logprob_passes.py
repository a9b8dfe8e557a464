"""The learner's log-prob passes alone, at the 0.5B workload's micro-batch (32 rows x 257 positions x a 151,936-token
vocabulary, bf16 logits): milliseconds per micro-batch and TB/s (one read of the logits forward, a read and a write
backward) for each way of computing them:

- `kernels`: what the learner runs on a GPU (learner/kernels.py, Triton);
- `eager`: what it runs on the CPU, block by block of positions (learner/logprobs.py);
- `compiled`: the same math through torch.compile with dynamic shapes, as the learner ran it before the kernels.

    python -m bench.logprob_passes [--rows 32 --positions 257 --vocab 151936 --temperature 0.7]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import result_name, write_result
from learner import logprobs


def _compiled_forward(block, targets, temp):
    x = block.float() if temp is None else block.float() / temp
    lse = torch.logsumexp(x, -1)
    return x.gather(-1, targets[..., None]).squeeze(-1) - lse, lse


def _compiled_backward(out, block, targets, lse, g, temp):
    x = block.float() if temp is None else block.float() / temp
    onehot = torch.arange(x.shape[-1], device=x.device) == targets[..., None]
    out.copy_((onehot.float() - torch.exp(x - lse[..., None])) * g[..., None])


def ms(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--positions", type=int, default=257)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=1.0, help="1: the passes without a division")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("logprob_passes needs a GPU", file=sys.stderr)
        return 2
    from learner import kernels

    torch.manual_seed(0)
    rows, t, v = args.rows, args.positions, args.vocab
    logits = (torch.randn(rows, t + 1, v, device="cuda") * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (rows, t), device="cuda")
    temp = None if args.temperature == 1 else torch.full((rows, 1, 1), args.temperature, device="cuda")
    g = torch.randn(rows, t, device="cuda") / (1 if temp is None else args.temperature)
    out = torch.empty_like(logits)
    logp, lse = kernels.forward(logits, targets, temp)
    blocks = list(logprobs._blocks(logits, t))
    fwd_c, bwd_c = (torch.compile(f, dynamic=True) for f in (_compiled_forward, _compiled_backward))

    ways = {
        "kernels": (lambda: kernels.forward(logits, targets, temp),
                    lambda: kernels.backward(out, logits, targets, lse, g, temp)),
        "eager": (lambda: logprobs.eager_forward(logits, targets, temp),
                  lambda: logprobs.eager_backward(out, logits, targets, g, temp)),
        "compiled": (lambda: [fwd_c(logits[r, q], targets[r, q], logprobs._rows(temp, r)) for r, q in blocks],
                     lambda: [bwd_c(out[r, q], logits[r, q], targets[r, q], lse[r, q], g[r, q], logprobs._rows(temp, r))
                              for r, q in blocks]),
    }
    read = rows * t * v * logits.element_size()
    metrics = {}
    for name, (forward, backward) in ways.items():
        f, b = ms(forward), ms(backward)
        metrics[name] = {"forward_ms": round(f, 2), "backward_ms": round(b, 2),
                         "forward_tb_s": round(read / f / 1e9, 2), "backward_tb_s": round(2 * read / b / 1e9, 2)}
        print(name, metrics[name], flush=True)
    want = torch.log_softmax(logits[:, :t].float() / (1 if temp is None else temp), -1)
    metrics["kernels_max_error"] = float((logp - want.gather(-1, targets[..., None]).squeeze(-1)).abs().max())
    write_result(result_name("logprob_passes", f"v{v}", f"t{args.temperature:g}"),
                 "python -m bench.logprob_passes " + " ".join(sys.argv[1:]),
                 f"bf16 logits [{rows}, {t + 1}, {v}], random", metrics, settings=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
