"""pipeline_speedup: learner steps/min at max_staleness 0, 1, 2, and how busy each GPU is.

One run, one learner GPU (0) and one generator GPU (1); `trainer.max_staleness` is changed while the
run goes on (`pipeline set`), so the three phases share one start. The workload is sized so that
generating a batch and training on it take about as long: 704-token prompts (training pays for them,
generation hardly: one prefill per group), 192 generated tokens, 32 groups x 8. Steps/min of a phase is measured between
its steps' end times, skipping the first `--skip` steps after each change (the pipeline refills).
GPU busy fraction: NVML utilisation sampled every 0.1 s, averaged over each phase. Target: k=1 >= 1.8x k=0.
CUDA graphs (`--enforce-eager 0`) make generation cheaper per token: longer completions balance it again.
`--engines-per-gpu N` starts N generators on the generator GPU (one after the other, each with 0.85/N of its
memory): a small model's vLLM step is host-bound, and one engine leaves most of the GPU idle.

    python -m bench.pipeline_speedup --model-size 0.5b
    python -m bench.pipeline_speedup --enforce-eager 0 --max-tokens 512 --phases 0,1
    python -m bench.pipeline_speedup --enforce-eager 0 --engines-per-gpu 2 --prompt-tokens 192 --phases 0,1
    python -m bench.pipeline_speedup --from-run RUN_DIR --skip 1 --name NAME   # re-read a run's metrics.jsonl
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from bench.common import (
    Services,
    add_model_args,
    machine,
    model_from_args,
    result_name,
    run_config,
    write_dataset,
    write_result,
)
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
    p.add_argument("--enforce-eager", type=int, default=1, help="0: CUDA graphs in the generator")
    p.add_argument("--max-num-seqs", type=int, default=None, help="generator.max_num_seqs (default: the config's)")
    p.add_argument("--engines-per-gpu", type=int, default=1, help="generators sharing the generator GPU")
    p.add_argument("--compile", action="store_true", help="trainer.compile (the learner's decoder layers)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="trainer.micro_batch_tokens (default: the config's)")
    p.add_argument("--cpu", action="store_true", help="no --gpus (CPU smoke run)")
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--from-run", type=Path, default=None,
                   help="summarise the metrics of an earlier run instead (no GPU busy figures)")
    p.add_argument("--run-machine", default="", help="with --from-run: the machine the run was made on")
    p.add_argument("--name", default=None, help="result file name (default e.g. pipeline_speedup_0.5b_4engines_h200x4)")
    args = p.parse_args()
    if args.from_run is not None:
        if not args.name:  # the run's machine is not this one
            p.error("--from-run needs --name")
        out = summarize(args.from_run, args.skip)
        write_result(args.name, "python -m bench.pipeline_speedup " + shlex.join(sys.argv[1:]),
                     f"random-weight Qwen2.5-{args.model_size} shape, bf16", out, run_dir=str(args.from_run),
                     machine={"run": args.run_machine, "summarised_on": machine()})
        return
    phases = [int(k) for k in args.phases.split(",")]
    model = str(model_from_args(args))
    # letters separated by spaces, and the word-level tokenizer gives the spaces ids too: n letters, 2n - 1 tokens
    data = write_dataset(Path(args.run_dir).parent / "speedup.jsonl", rows=4096,
                         prompt_tokens=(args.prompt_tokens + 1) // 2)
    per_phase = args.steps + args.skip
    engines = args.engines_per_gpu
    cfg = run_config(model, str(data),
                     sampling={"max_tokens": args.max_tokens},
                     trainer={"total_steps": per_phase * len(phases) + 2 + 20 * (engines - 1),
                              "batch_size": args.batch_size, "group_size": args.group_size,
                              "max_staleness": phases[0], "compile": args.compile,
                              **({"micro_batch_tokens": args.micro_batch_tokens}
                                 if args.micro_batch_tokens is not None else {})},
                     generator={"lease_size": 8, "enforce_eager": bool(args.enforce_eager),
                                **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs is not None else {}),
                                "max_model_len": args.prompt_tokens + args.max_tokens + 64,
                                **({"gpu_memory_utilization": round(0.85 / engines, 2)} if engines > 1 else {})},
                     weights={"transport": args.transport})
    if args.cpu:
        cfg["model"]["dtype"] = "float32"
    sampler = GpuSampler().start()
    deadline = time.monotonic() + args.timeout
    error, warmup = "", 0
    with Services(Path(args.run_dir), cfg, use_gpus=not args.cpu) as svc:
        svc.start_learner()
        try:
            for i in range(engines):  # one vLLM start at a time: each sizes its KV cache from the free memory
                svc.start_generator(f"generator-{i}")
                svc.wait_registered(i + 1, timeout=max(10, deadline - time.monotonic()))
            warmup = len(svc.metrics())  # steps trained before every engine was up: not measured
            for i, k in enumerate(phases):
                if i:
                    svc.set("trainer.max_staleness", k)
                svc.wait_steps(warmup + (i + 1) * per_phase, timeout=max(10, deadline - time.monotonic()))
        except RuntimeError as e:  # out of time: the phases measured so far are kept
            error = str(e).splitlines()[0]
        sampler.stop()
    out = summarize(svc.run_dir, args.skip, sampler, warmup)
    out["workload"] = {"batch_size": args.batch_size, "group_size": args.group_size,
                       "max_tokens": args.max_tokens,
                       "prompt_tokens": args.prompt_tokens, "transport": args.transport,
                       "enforce_eager": bool(args.enforce_eager), "engines_per_gpu": engines, "warmup_steps": warmup,
                       "compile": args.compile, "micro_batch_tokens": cfg["trainer"].get("micro_batch_tokens")}
    out["sampler_error"], out["error"] = sampler.error, error
    name = args.name or result_name("pipeline_speedup", args.model_size, f"{engines}engine{'s' if engines > 1 else ''}",
                                    gpus=not args.cpu)
    write_result(name, "python -m bench.pipeline_speedup " + shlex.join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16", out, run_dir=str(args.run_dir))


def summarize(run_dir: Path, skip: int, sampler: GpuSampler | None = None, warmup: int = 0) -> dict:
    """Per phase (consecutive steps with one max_staleness), skipping the first `warmup` steps of the run and
    the first `skip` of each phase: steps/min between the steps' end times, mean train/wait/sync, and (given
    the sampler) each GPU's busy fraction."""
    from pipeline.metrics import read_jsonl

    records = read_jsonl(run_dir / "metrics.jsonl")
    last_unix = (run_dir / "metrics.jsonl").stat().st_mtime  # the end of its last record
    runs: list[list[dict]] = []
    for r in records[warmup:]:
        if not runs or runs[-1][0]["max_staleness"] != r["max_staleness"]:
            runs.append([])
        runs[-1].append(r)
    out = {"phases": {}}
    for rs in runs:
        rs = rs[skip:]
        if len(rs) < 2:
            continue
        ends = [r["time/elapsed_s"] for r in rs]
        span = ends[-1] - ends[0]
        phase = {
            "max_staleness": rs[0]["max_staleness"], "steps": len(rs), "steps_per_min": (len(rs) - 1) / span * 60,
            "step_s_mean": span / (len(rs) - 1),
            "train_s_mean": sum(r["time/step_s"] for r in rs) / len(rs),
            "wait_s_mean": sum(r["time/wait_s"] for r in rs) / len(rs),
            "sync_ms_mean": sum(r["sync/weights_ms"] for r in rs) / len(rs),
            "max_lag": max(r["staleness/max_lag"] for r in rs),
            "tokens_per_s": sum(r["throughput/tokens_per_s"] for r in rs) / len(rs),
        }
        if sampler is not None:  # the window in unix time: the learner's clock anchored at the last record
            busy = sampler.busy(last_unix - (records[-1]["time/elapsed_s"] - ends[0]),
                                last_unix - (records[-1]["time/elapsed_s"] - ends[-1]))
            phase["gpu_busy"] = {"learner_gpu0": busy[0], "generator_gpu1": busy[1]} if busy and len(busy) > 1 else busy
        out["phases"][f"k{phase['max_staleness']}"] = phase
    k0 = out["phases"].get("k0", {}).get("steps_per_min")
    for ph in out["phases"].values():
        ph["speedup_vs_k0"] = ph["steps_per_min"] / k0 if k0 else None
    out["target"] = "k1 >= 1.8x k0, both GPUs busy >= 90% at k1"
    return out


if __name__ == "__main__":
    main()
