"""The learner step alone: seconds per step, trained tokens/s and peak GPU memory of `learner.step.train_step` on
issue 16's workload (a random-weight model of a Qwen2.5 shape, bf16, 32 prompts x 8 samples of 64 + 256 tokens),
and a profile of one step (the operators that take the most GPU time). No vLLM, no hub: synthetic groups with
random tokens and rewards.

    python -m bench.learner_step [--size 0.5b] [--steps 5] [--profile] [--syncs]
        [--set trainer.micro_batch_tokens=16384 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import build_model, result_name, write_result
from learner.model import build_engine, init_distributed
from learner.step import train_step
from pipeline import protocol as P
from pipeline.config import config_from_dict


def groups(n: int, size: int, prompt: int, completion: int, vocab: int, seed: int) -> list[P.RolloutGroup]:
    rng = np.random.default_rng(seed)
    out = []
    for pid in range(n):
        samples = [P.Sample(P.pack_ints(rng.integers(0, vocab, completion).tolist()),
                            P.pack_floats((-rng.random(completion) * 5).tolist()), float(rng.random()), [], "length")
                   for _ in range(size)]
        out.append(P.RolloutGroup(1, "g", pid, 0, P.pack_ints(rng.integers(0, vocab, prompt).tolist()), samples))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.5b")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--completion-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    p.add_argument("--profile", action="store_true", help="profile one more step: the top operators by GPU time")
    p.add_argument("--syncs", action="store_true", help="one more step in CUDA's sync debug mode: the host-device "
                   "synchronisations it makes, counted by the code that made them")
    p.add_argument("--set", action="append", default=[], help="a config override, e.g. trainer.loss=ppo")
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--name", default="")
    args = p.parse_args()
    path = build_model(args.size, Path(args.models) / f"q-{args.size}")
    cuda = torch.cuda.is_available()
    cfg = config_from_dict({"model": {"path": str(path), "dtype": "bfloat16" if cuda else "float32"},
                            "trainer": {"batch_size": args.batch_size, "group_size": args.group_size, "lr": 1e-6},
                            "sampling": {"max_tokens": args.completion_tokens},
                            "generator": {"max_model_len": args.prompt_tokens + args.completion_tokens}},
                           args.set)
    init_distributed()
    engine, extras = build_engine(cfg, str(path))
    vocab = engine.module.config.vocab_size
    times, stats = [], {}
    for i in range(2 + args.steps):
        batch = groups(args.batch_size, args.group_size, args.prompt_tokens, args.completion_tokens, vocab, i)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = train_step(engine, extras, batch, cfg, i, 0)
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        print(f"step {i}: {time.perf_counter() - t0:.3f} s, loss {stats['loss']:.4f}", flush=True)
    tokens = args.batch_size * args.group_size * (args.prompt_tokens + args.completion_tokens)
    out = {"step_s": round(statistics.median(times), 4), "steps_s": [round(t, 4) for t in times],
           "tokens_per_s": round(tokens / statistics.median(times)), "tokens": tokens,
           "trained_tokens": stats["tokens/trained"], "micro_batch_tokens": stats["learner/micro_batch_tokens"],
           "peak_gpu_gib": round(stats["learner/peak_gpu_gib"], 2) if cuda else None,  # of forwards and backwards
           "reserved_gpu_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None}
    if args.profile:
        out["profile"] = profile(engine, extras, cfg, args, vocab)
    if args.syncs:
        out["syncs"] = syncs(engine, extras, cfg, args, vocab)
    print(out, flush=True)
    write_result(result_name("learner_step", args.size, *([args.name] if args.name else [])),
                 "python -m bench.learner_step " + " ".join(sys.argv[1:]), f"Qwen2.5 shape {args.size}, random weights",
                 out, settings={"micro_batch_tokens": cfg.trainer.micro_batch_tokens, "loss": cfg.trainer.loss,
                                "minibatches": cfg.trainer.minibatches, "overrides": args.set})
    return 0


def syncs(engine, extras, cfg, args, vocab: int) -> dict:
    """One step with torch.cuda's sync debug mode on: each synchronising call warns, and the warnings are counted
    by the last three frames outside torch that led to it (site-packages paths shortened). {"total", "by_caller"}."""
    import traceback
    import warnings

    counts: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and not f.filename.endswith("warnings.py")]
        where = " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in frames[-3:][::-1])
        counts[where] = counts.get(where, 0) + 1

    if not torch.cuda.is_available():
        return {"total": None, "by_caller": {}}
    batch = groups(args.batch_size, args.group_size, args.prompt_tokens, args.completion_tokens, vocab, 98)
    torch.cuda.synchronize()
    shown, filters = warnings.showwarning, warnings.filters[:]
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    try:
        train_step(engine, extras, batch, cfg, 98, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning, warnings.filters[:] = shown, filters
    ranked = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    print(json.dumps(ranked, indent=1), flush=True)
    return {"total": sum(counts.values()), "by_caller": ranked}


def profile(engine, extras, cfg, args, vocab: int) -> dict:
    """One step under the profiler: the 15 operators that take the most device time (self time, ms), the 15 that
    take the most host time, and the share of the step's wall time in which the GPU ran a kernel (near 1: the
    step is bound by the GPU's work; well below: by the host launching it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    batch = groups(args.batch_size, args.group_size, args.prompt_tokens, args.completion_tokens, vocab, 99)
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        train_step(engine, extras, batch, cfg, 99, 0)
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    out = {}
    for name, key in (("device_top", "self_device_time_total"), ("host_top", "self_cpu_time_total")):
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:15]
        out[name] = [{"op": e.key[:80], "ms": round(getattr(e, key, 0) / 1000, 1), "calls": e.count} for e in events]
    if cuda:
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA)
        busy, end = 0.0, float("-inf")
        for start, stop in spans:  # the union of the kernels' intervals
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        out["gpu_busy_share"] = round(busy / wall_us, 3)
        out["kernels"] = len(spans)
    print(json.dumps(out, indent=1), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
