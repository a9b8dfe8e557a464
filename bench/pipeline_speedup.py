"""pipeline_speedup: learner steps/min at max_staleness 0, 1, 2, and how busy each GPU is.

One run, one learner GPU (0) and one generator GPU (1); `trainer.max_staleness` is changed while the
run goes on (`pipeline set`), so the three phases share one start. The workload is sized so that
generating a batch and training on it take about as long: 704-token prompts (training pays for them,
generation hardly: one prefill per group), 192 generated tokens, 32 groups x 8. Steps/min of a phase is measured between
its steps' end times, skipping the first `--skip` steps after each change (the pipeline refills).
GPU busy fraction: NVML utilisation sampled every 0.1 s, averaged over each phase. Target: k=1 >= 1.8x k=0.

    python -m bench.pipeline_speedup --model-size 0.5b
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import Services, add_model_args, model_from_args, run_config, write_dataset, write_result
from bench.gpu_sampler import GpuSampler


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, "pipeline_speedup")
    p.add_argument("--phases", default="0,1,2")
    p.add_argument("--steps", type=int, default=6, help="steps per phase")
    p.add_argument("--skip", type=int, default=1, help="steps skipped after each change")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--prompt-tokens", type=int, default=704,
                   help="long prompts cost training time, little generation time: this balances the two")
    p.add_argument("--transport", default="shm")
    p.add_argument("--cpu", action="store_true", help="no --gpus (CPU smoke run)")
    p.add_argument("--timeout", type=float, default=420)
    args = p.parse_args()
    phases = [int(k) for k in args.phases.split(",")]
    model = str(model_from_args(args))
    # letters separated by spaces, and the word-level tokenizer gives the spaces ids too: n letters, 2n - 1 tokens
    data = write_dataset(Path(args.run_dir).parent / "speedup.jsonl", rows=4096,
                         prompt_tokens=(args.prompt_tokens + 1) // 2)
    per_phase = args.steps + args.skip
    cfg = run_config(model, str(data),
                     sampling={"max_tokens": args.max_tokens},
                     trainer={"total_steps": per_phase * len(phases) + 2, "batch_size": args.batch_size,
                              "group_size": args.group_size, "max_staleness": phases[0]},
                     generator={"max_inflight_groups": args.batch_size, "lease_size": 8,
                                "max_model_len": args.prompt_tokens + args.max_tokens + 64},
                     weights={"transport": args.transport})
    if args.cpu:
        cfg["model"]["dtype"] = "float32"
    sampler = GpuSampler().start()
    deadline = time.monotonic() + args.timeout
    with Services(Path(args.run_dir), cfg, use_gpus=not args.cpu) as svc:
        svc.start_learner()
        svc.start_generator()
        switches = []  # (phase k, metrics index where it starts, unix time)
        for i, k in enumerate(phases):
            if i:
                svc.set("trainer.max_staleness", k)
            switches.append((k, len(svc.metrics()), time.time()))
            svc.wait_steps((i + 1) * per_phase, timeout=max(10, deadline - time.monotonic()))
        sampler.stop()
    records = svc.metrics()  # re-read after the stop: the file's mtime is the end of its last record
    last_unix = (svc.run_dir / "metrics.jsonl").stat().st_mtime
    out = {"phases": {}, "workload": {"batch_size": args.batch_size, "group_size": args.group_size,
                                      "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                                      "transport": args.transport}}
    for k, first, _ in switches:
        last = first + per_phase
        rs = records[first + args.skip:last]
        ends = [r["time/elapsed_s"] for r in rs]
        span = ends[-1] - ends[0]
        steps_per_min = (len(rs) - 1) / span * 60 if span > 0 else None
        # unix times of the window: the learner's elapsed clock anchored at the last record's write
        t0_unix = last_unix - (records[-1]["time/elapsed_s"] - ends[0])
        t1_unix = last_unix - (records[-1]["time/elapsed_s"] - ends[-1])
        busy = sampler.busy(t0_unix, t1_unix)
        out["phases"][f"k{k}"] = {
            "max_staleness": k, "steps": len(rs), "steps_per_min": steps_per_min,
            "step_s_mean": span / max(1, len(rs) - 1),
            "train_s_mean": sum(r["time/step_s"] for r in rs) / len(rs),
            "wait_s_mean": sum(r["time/wait_s"] for r in rs) / len(rs),
            "sync_ms_mean": sum(r["sync/weights_ms"] for r in rs) / len(rs),
            "max_lag": max(r["staleness/max_lag"] for r in rs),
            "tokens_per_s": sum(r["throughput/tokens_per_s"] for r in rs) / len(rs),
            "gpu_busy": {"learner_gpu0": busy[0], "generator_gpu1": busy[1]} if busy and len(busy) > 1 else busy,
        }
    k0 = out["phases"].get("k0", {}).get("steps_per_min")
    for ph in out["phases"].values():
        ph["speedup_vs_k0"] = ph["steps_per_min"] / k0 if k0 and ph["steps_per_min"] else None
    out["target"] = "k1 >= 1.8x k0"
    out["sampler_error"] = sampler.error
    write_result("pipeline_speedup", "python -m bench.pipeline_speedup " + " ".join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16", out, run_dir=str(args.run_dir))


if __name__ == "__main__":
    main()
