"""colocated: the whole system on one GPU, `pipeline run -c configs/gpu-single.yaml`, learner and generator
sharing GPU 0 with split memory (vLLM's `gpu_memory_utilization`, the learner the rest).

The config's placement and memory split as shipped, with a random-weight model of Qwen2.5-0.5B's shape
and the bench dataset and reward in place of the embedded toy task. Reports steps/min, the weight
transport `auto` picked (shm: nccl cannot put both ends on one device), the GPU memory peak (NVML),
and whether the run completed.

    python -m bench.colocated --steps 20
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

from bench.common import ROOT, add_model_args, model_from_args, result_name, start_child, write_dataset, write_result
from pipeline.metrics import read_jsonl


def _memory_peak(stop: threading.Event, peak: list[int]) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not stop.is_set():
            peak[0] = max(peak[0], pynvml.nvmlDeviceGetMemoryInfo(h).used)
            time.sleep(0.2)
    except Exception:  # no NVML (CPU smoke run)
        return


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, "colocated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--name", default=None, help="result file name (default: colocated_SIZE_MACHINE)")
    args = p.parse_args()
    model = str(model_from_args(args))
    run_dir = Path(args.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    data = write_dataset(run_dir.parent / "colocated.jsonl", rows=2048)
    cfg = yaml.safe_load((ROOT / "configs" / "gpu-single.yaml").read_text())
    cfg["model"] = {"path": model, "dtype": "bfloat16"}
    cfg["data"] = {"path": str(data)}
    cfg["rewards"] = [{"fn": "bench.common:parity_reward"}]
    cfg["sampling"] = {"max_tokens": 128, "ignore_eos": True}
    cfg["trainer"].update(total_steps=args.steps, batch_size=16, group_size=8)
    cfg["generator"]["max_model_len"] = 512
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir.parent / "colocated.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stop, peak = threading.Event(), [0]
    threading.Thread(target=_memory_peak, args=(stop, peak), daemon=True).start()
    t0 = time.time()
    argv = [sys.executable, "-m", "pipeline.cli", "run", "-c", str(cfg_path), "--run-dir", str(run_dir)]
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
           "config": "configs/gpu-single.yaml (placement, memory split), bench model/data/reward"}
    name = args.name or result_name("colocated", args.model_size)
    write_result(name, "python -m bench.colocated " + " ".join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16", out)


if __name__ == "__main__":
    main()
