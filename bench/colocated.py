"""colocated: the whole system on one GPU, `pipeline run -c configs/gpu-single.yaml`, learner and generator
sharing GPU 0 with split memory (vLLM's `gpu_memory_utilization`, the learner the rest).

The config's placement and memory split as shipped, with a random-weight model of Qwen2.5-0.5B's shape
and the bench dataset and reward in place of the embedded toy task. Reports steps/min, the weight
transport `auto` picked (ipc: CUDA IPC from the learner's buffers; `--transport shm` for the file path), the
GPU memory peak (NVML),
and whether the run completed.

    python -m bench.colocated --steps 20 [--batch-size 32 --group-size 8 --prompt-tokens 64 --max-tokens 256
                                          --k 1 --enforce-eager 0]   (issue 16's one-GPU workload)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from bench.common import (
    ROOT,
    add_model_args,
    memory_peak,
    model_from_args,
    result_name,
    start_child,
    write_dataset,
    write_result,
)
from pipeline.metrics import read_jsonl


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, "colocated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=None, help="trainer.max_staleness (default: the config's)")
    p.add_argument("--inflight", type=int, default=None, help="generator.max_inflight_groups (default: the config's)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="generator.max_num_seqs (default: the config's)")
    p.add_argument("--enforce-eager", type=int, default=None, help="0: CUDA graphs (default: the config's)")
    p.add_argument("--lr", type=float, default=None, help="trainer.lr (default: the config's)")
    p.add_argument("--transport", default=None, help="weights.transport (default: the config's, auto: ipc)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="trainer.micro_batch_tokens (default: the config's)")
    p.add_argument("--generators", type=int, default=1, help="engines on the GPU (run.generators), splitting the "
                   "config's generator.gpu_memory_utilization between them")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--name", default=None, help="result file name (default: colocated_SIZE_MACHINE)")
    args = p.parse_args()
    model = str(model_from_args(args))
    run_dir = Path(args.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    data = write_dataset(run_dir.parent / f"colocated{args.prompt_tokens}.jsonl", rows=2048,
                         prompt_tokens=(args.prompt_tokens + 1) // 2)  # a letter and a space: 2 tokens (as speedup's)
    cfg = yaml.safe_load((ROOT / "configs" / "gpu-single.yaml").read_text())
    cfg["model"] = {"path": model, "dtype": "bfloat16"}
    cfg["data"] = {"path": str(data)}
    cfg["rewards"] = [{"fn": "bench.common:parity_reward"}]
    cfg["sampling"] = {"max_tokens": args.max_tokens, "ignore_eos": True}
    cfg["trainer"].update(total_steps=args.steps, batch_size=args.batch_size, group_size=args.group_size)
    cfg["generator"]["max_model_len"] = max(512, args.prompt_tokens + args.max_tokens + 64)  # room for a template
    if args.k is not None:
        cfg["trainer"]["max_staleness"] = args.k
    if args.lr is not None:
        cfg["trainer"]["lr"] = args.lr
    if args.inflight is not None:
        cfg["generator"]["max_inflight_groups"] = args.inflight
    if args.max_num_seqs is not None:
        cfg["generator"]["max_num_seqs"] = args.max_num_seqs
    if args.enforce_eager is not None:
        cfg["generator"]["enforce_eager"] = bool(args.enforce_eager)
    if args.transport is not None:
        cfg["weights"]["transport"] = args.transport
    if args.micro_batch_tokens is not None:
        cfg["trainer"]["micro_batch_tokens"] = args.micro_batch_tokens
    if args.generators > 1:
        cfg["run"]["generators"] = args.generators
        cfg["generator"]["gpu_memory_utilization"] = round(cfg["generator"]["gpu_memory_utilization"] / args.generators,
                                                           3)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / "colocated.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stop, peak = threading.Event(), [0]
    threading.Thread(target=memory_peak, args=(stop, peak), daemon=True).start()
    t0 = time.time()
    argv = [sys.executable, "-m", "pipeline", "run", "-c", str(cfg_path), "--run-dir", str(run_dir)]
    log_path = run_dir.parent / "colocated.log"
    log_path.unlink(missing_ok=True)  # this run's alone
    child = start_child("colocated", argv, log_path)
    try:
        rc = child.proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        child.stop(grace=5)
        stop.set()
    wall = time.time() - t0
    records, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    rs = records[2:]  # the first steps include the engine's first use
    span = rs[-1]["time/elapsed_s"] - rs[0]["time/elapsed_s"] if len(rs) > 1 else 0
    out = {"returncode": rc, "steps": len(records), "wall_s": wall,
           "steps_per_min": (len(rs) - 1) / span * 60 if span else None,
           "train_s_mean": sum(r["time/step_s"] for r in rs) / len(rs) if rs else None,
           "wait_s_mean": sum(r["time/wait_s"] for r in rs) / len(rs) if rs else None,
           "sync_ms_mean": sum(r["sync/weights_ms"] for r in rs) / len(rs) if rs else None,
           "transports": sorted({e["transport"] for e in events if e["event"] == "register"}),
           "gpu_memory_peak_gib": peak[0] / 2**30,
           "reward_first_last": [records[0]["reward/mean"], records[-1]["reward/mean"]] if records else None,
           "time_per_step_s": span / (len(rs) - 1) if span else None,
           "config": "configs/gpu-single.yaml (placement, memory split), bench model/data/reward",
           "settings": {k: v for k, v in vars(args).items() if k not in ("run_dir", "name", "model_dir")}}
    name = args.name or result_name("colocated", args.model_size)
    write_result(name, "python -m bench.colocated " + " ".join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16", out)


if __name__ == "__main__":
    main()
