"""Bytes per version of the zmq transport's delta sync (weights/delta.py), on Qwen2.5 shapes, on CPU.

One optimizer step is simulated on random weights of a real shape: fp32 master weights ~ N(0, 0.02), moved by
`lr` per element (Adam's first step is about lr x sign(gradient)), published in bf16 as the learner does. The
two versions are serialised as the learner serialises them, and the delta is what a generator holding the first
pulls instead of the second's blob. Reports, per learning rate, the fraction of bf16 elements that changed, the
blob and delta sizes, and the time to encode and apply the delta. The embedded demo's figure comes from its
metrics (`sync/blob_bytes`, `sync/delta_bytes`; float32 weights, lr 2e-3: nearly every element changes).

    python -m bench.delta_sync --sizes 0.5b,1.5b --lrs 1e-6,1e-5
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from bench.common import qwen_shaped_config, result_name, write_result
from weights import delta
from weights.plan import serialize


def shapes(size: str) -> list[tuple[str, tuple]]:
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen_shaped_config(size))
    return [(n, tuple(p.shape)) for n, p in model.state_dict().items()]


def measure(size: str, lr: float, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    master = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes(size)}
    before = serialize((n, t.to(torch.bfloat16)) for n, t in master.items())
    changed = total = 0
    for t in master.values():
        old = t.to(torch.bfloat16)
        t -= lr * torch.sign(torch.randn(t.shape, generator=gen))
        changed += int((t.to(torch.bfloat16) != old).sum())
        total += t.numel()
    after = serialize((n, t.to(torch.bfloat16)) for n, t in master.items())
    del master
    gc.collect()
    start = time.perf_counter()
    diff = delta.encode(before, after)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    assert delta.apply(before, diff).tobytes() == after
    apply_s = time.perf_counter() - start
    return {"size": size, "lr": lr, "elements_changed": round(changed / total, 4), "blob_bytes": len(after),
            "delta_bytes": len(diff), "delta_over_blob": round(len(diff) / len(after), 4),
            "encode_s": round(encode_s, 2), "apply_s": round(apply_s, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.5b")
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--name", default=None, help="result file name (default: delta_sync_SIZES_cpuN)")
    args = p.parse_args(argv)
    rows = []
    for size in args.sizes.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            rows.append(measure(size, lr))
            print(rows[-1], flush=True)
    command = "python -m bench.delta_sync " + " ".join(argv if argv is not None else sys.argv[1:])
    write_result(args.name or result_name("delta_sync", args.sizes, gpus=False), command,
                 f"Qwen2.5 shapes {args.sizes}, random weights, bf16, one simulated optimizer step",
                 {"versions": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
