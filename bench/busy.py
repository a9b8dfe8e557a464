"""Every GPU busy (issue 41): profiled runs of a shipped config side by side, each job on GPUs of its own, and vLLM's
offline engine on the same prompts and sampling; each run summarised by bench/timeline.py.

    python -m bench.busy --config configs/gpu-smollm2-math.yaml --steps 60 --timeout 280 \\
        --wave "one:0:1 three:2:3,3,3" --wave "colocated:0:0 k2:2:3:trainer.max_staleness=2 engine:1"

A wave's jobs start together; the next wave starts when they have all ended. A job is NAME:LEARNER_GPU:GENERATOR_GPUS
[:KEY=VALUE;...]: `pipeline run -c CONFIG --profile` with run.learner_gpus, one generator per listed GPU
(run.generators, run.generator_gpus; "3,3,3" is three engines on GPU 3, each with the config's
generator.gpu_memory_utilization), trainer.total_steps --steps and the given overrides; nothing else differs from
the config. `engine:GPU` is vLLM's offline LLM.generate with the config's generator settings on one step's batch of
training prompts per round (bench/vs_trl_arith.py's engine side). Launch time counts from the command. Results:
bench/results/busy_<config>_<machine>.json, one entry per job with its settings, and the runs' directories
(trace.json, metrics.jsonl, logs) under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import timeline
from bench.common import result_name, start_child, write_result

ROOT = Path(__file__).resolve().parent.parent


def job_argv(spec: str, args) -> tuple[str, list[str], list[str]]:
    """(name, argv, the overrides it differs from the config by)"""
    name, learner, *rest = spec.split(":", 3)
    run_dir = args.out / name
    if name.startswith("engine"):
        return name, [sys.executable, "-m", "bench.vs_trl_arith", "--engine-child", str(run_dir / "engine.json"),
                      "--config", args.config, "--rounds", "8"], [f"CUDA_VISIBLE_DEVICES={learner}"]
    gens = rest[0].split(",")
    sets = [f"trainer.total_steps={args.steps}", f"run.learner_gpus='{learner}'",
            f"run.generator_gpus={json.dumps(gens)}", f"run.generators={len(gens)}"]
    sets += [s for s in (rest[1].split(";") if len(rest) > 1 else []) if s]
    argv = [sys.executable, "-m", "pipeline.cli", "run", "-c", args.config, "--profile", "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return name, argv, sets


def wave(specs: list[str], args) -> dict:
    started = {}
    for spec in specs:
        name, argv, sets = job_argv(spec, args)
        (args.out / name).mkdir(parents=True, exist_ok=True)
        env = {"CUDA_VISIBLE_DEVICES": spec.split(":")[1]} if name.startswith("engine") else None
        started[name] = (start_child(name, argv, args.out / f"{name}.log", env), time.time(), sets, spec)
    deadline = time.monotonic() + args.timeout
    out = {}
    for name, (child, launched, sets, spec) in started.items():
        while child.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        code = child.proc.poll()
        if code is None:
            child.stop(grace=20)
        entry = {"job": spec, "overrides": sets, "exit": code, "timed_out": code is None}
        try:
            if name.startswith("engine"):
                entry["engine"] = json.loads((args.out / name / "engine.json").read_text())
            else:
                entry.update(timeline.summary(args.out / name, launched, args.skip))
        except (OSError, ValueError, KeyError, IndexError) as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        out[name] = entry
        print(name, json.dumps(entry)[:2000], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu-smollm2-math.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the rates")
    p.add_argument("--timeout", type=float, default=280, help="seconds per wave")
    p.add_argument("--wave", action="append", required=True, help="jobs that run side by side (see above)")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench-runs/busy"))
    p.add_argument("--name", default="", help="added to the result's name")
    args = p.parse_args()
    results = {}
    for specs in args.wave:
        results.update(wave(specs.split(), args))
        name = result_name("busy", Path(args.config).stem, args.name)
        write_result(name, "python -m bench.busy " + " ".join(sys.argv[1:]), args.config, results, quiet=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
