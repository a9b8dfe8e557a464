"""Every GPU busy (issue 41): profiled runs of a shipped config side by side, each job on GPUs of its own, and vLLM's
offline engine on the same prompts and sampling; each run summarised by bench/timeline.py.

    python -m bench.busy --config configs/gpu-smollm2-math.yaml --steps 60 --timeout 280 \\
        --wave "one:0:1 three:2:3,3,3" --wave "colocated:0:0 k2:2:3:trainer.max_staleness=2 engine:1"

A wave's jobs start together; the next wave starts when they have all ended. A job is NAME:LEARNER_GPU:GENERATOR_GPUS
[:KEY=VALUE;...]: `pipeline run -c CONFIG --profile` with run.learner_gpus, one generator per listed GPU
(run.generators, run.generator_gpus; "3,3,3" is three engines on GPU 3, each with the config's
generator.gpu_memory_utilization), trainer.total_steps --steps and the given overrides; nothing else differs from
the config. `engine:GPU[::KEY=VALUE;...]` is vLLM's offline LLM.generate with the config's generator settings (and the
overrides) on one step's batch of training prompts per round (bench/vs_trl_arith.py's engine side). Launch time
counts from the command. Results: bench/results/busy_<config>_<machine>.json, one entry per job with its settings,
and the runs' directories (trace.json, metrics.jsonl, logs) under --out.

A generator added while a run goes on, as a user adds one: `--join NAME:GPU@STEP` starts `pipeline generator -c
RUN_DIR/launch.yaml --gpus GPU --learner ADDRESS` (the address from RUN_DIR/hub.json) once job NAME has trained STEP
steps. The job's entry then has `phases`: steps/min and the learner's wait with 1, 2, ... generators (from the
--settle-th step after a generator registered to the next registration), and each join's seconds from its command to
its registration and the steps right after it.

`--shape 0.5b` is the generation-heavy workload: the config's settings but for a random-weight model of that shape
(bench/common.py), random 32-letter prompts, the parity reward (a random model's rewards vary), 1,024-token completions
(ignore_eos) and no evaluation; the overrides are listed with each job.

    python -m bench.busy --config configs/gpu-qwen-math.yaml --shape 0.5b --steps 40 --timeout 560 \
        --wave "grow:0:1" --join grow:2@6 --join grow:3@14
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from bench import timeline
from bench.common import MODELS, build_model, result_name, start_child, write_dataset, write_result
from pipeline import trace
from pipeline.metrics import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def job_argv(spec: str, args) -> tuple[str, list[str], list[str]]:
    """(name, argv, the overrides it differs from the config by)"""
    parts = spec.split(":", 3)
    if len(parts) < (2 if parts[0].startswith("engine") else 3):
        raise SystemExit(f"bench.busy: job {spec!r} names no generator GPUs: NAME:LEARNER_GPU:GENERATOR_GPUS"
                         "[:KEY=VALUE;...], or engine...:GPU for vLLM's offline engine (a name that starts with "
                         "'engine')")
    name, learner, *rest = parts
    run_dir = args.out / name
    given = [s for s in (rest[1].split(";") if len(rest) > 1 else []) if s]  # the job's own KEY=VALUE overrides
    if name.startswith("engine"):
        return name, [sys.executable, "-m", "bench.vs_trl_arith", "--engine-child", str(run_dir / "engine.json"),
                      "--config", args.config, "--rounds", "8", *_set_flags(given)], [
                          f"CUDA_VISIBLE_DEVICES={learner}", *given]
    gens = rest[0].split(",")
    sets = [*args.shape_sets, f"trainer.total_steps={args.steps}", f"run.learner_gpus='{learner}'",
            f"run.generator_gpus={json.dumps(gens)}", f"run.generators={len(gens)}", *given]
    return name, [sys.executable, "-m", "pipeline", "run", "-c", args.config, "--profile", "--run-dir", str(run_dir),
                  *_set_flags(sets)], sets


def _set_flags(sets: list[str]) -> list[str]:
    """`--set KEY=VALUE` for each override."""
    return [x for s in sets for x in ("--set", s)]


def wave(specs: list[str], args, first: bool = False) -> dict:
    started, joins = {}, {}
    for spec in specs:
        name, argv, sets = job_argv(spec, args)
        shutil.rmtree(args.out / name, ignore_errors=True)  # a run directory holds one run
        (args.out / name).mkdir(parents=True)
        env = {"CUDA_VISIBLE_DEVICES": spec.split(":")[1]} if name.startswith("engine") else None
        started[name] = (start_child(name, argv, args.out / f"{name}.log", env), time.time(), sets, spec)
        joins[name] = sorted((int(step), gpu) for j in args.join if j.split(":")[0] == name
                             for gpu, step in [j.split(":", 1)[1].split("@")])
    joined: dict[str, list] = {name: [] for name in started}
    deadline = time.monotonic() + (args.first_timeout if first else args.timeout)
    while any(c.proc.poll() is None for c, *_ in started.values()) and time.monotonic() < deadline:
        for name, pending in joins.items():
            while pending and started[name][0].proc.poll() is None and trained(args.out / name) >= pending[0][0]:
                step, gpu = pending.pop(0)
                joined[name].append(join(name, gpu, step, args.out / name))
        time.sleep(1)
    out = {}
    for name, (child, launched, sets, spec) in started.items():
        code = child.proc.poll()
        if code is None:
            child.stop(grace=20)
        for j in joined[name]:
            j["child"].stop(grace=10)
        entry = {"job": spec, "overrides": sets, "exit": code, "timed_out": code is None}
        try:
            if name.startswith("engine"):
                entry["engine"] = json.loads((args.out / name / "engine.json").read_text())
            else:
                entry.update(timeline.summary(args.out / name, launched, args.skip))
            if joined[name]:
                entry["phases"] = phases(args.out / name, launched, joined[name], args.settle)
        except (OSError, ValueError, KeyError, IndexError) as e:
            entry["error"] = f"{type(e).__name__}: {e}"
        out[name] = entry
        print(name, json.dumps(entry)[:2000], flush=True)
    return out


def trained(run_dir: Path) -> int:
    """Steps the run has recorded so far."""
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def join(name: str, gpu: str, step: int, run_dir: Path) -> dict:
    """`pipeline generator` on `gpu` for the running job, as a user adds one (its trace goes with the run's)."""
    address = json.loads((run_dir / "hub.json").read_text())["address"]
    argv = [sys.executable, "-m", "pipeline", "generator", "-c", str(run_dir / "launch.yaml"), "--gpus", gpu,
            "--learner", address, "--profile", str(trace.trace_dir(run_dir))]
    child = start_child(f"{name}-join-{gpu}", argv, run_dir / "logs" / f"joined-{gpu}.log")
    print(f"{name}: generator on GPU {gpu} joins after step {step}", flush=True)
    return {"gpu": gpu, "after_step": step, "launched": time.time(), "child": child}


def phases(run_dir: Path, launched: float, joined: list[dict], settle: int) -> dict:
    """Steps/min and the learner's wait share with each number of registered generators, and what each join took;
    the run's tail (its last steps, trained after the engines' last group: timeline.while_generating) in no rate."""
    registered = sorted(e["time"] for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "register")
    spans = trace.spans(trace.read(run_dir / "trace.json"))
    learner = [e for e in spans if e["track"] == "learner" and e["name"] == "step"]
    generate = [e for e in spans if e["name"] == "generate"]  # the run's tail counts in no phase's rate
    steps = sorted(((e["ts"] + e["dur"]) / 1e6, e["dur"] / 1e6) for e in timeline.while_generating(learner, generate))
    waits = timeline.learner_waits(spans)  # less what the learner computed while it waited
    out = []
    for n, since in enumerate(registered, 1):
        until = registered[n] if n < len(registered) else float("inf")
        ends = [t for t, _ in steps if since < t <= until][settle - 1:]
        row = {"generators": n, "registered_s": round(since - launched, 1), "steps": max(0, len(ends) - 1)}
        if len(ends) >= 3:
            busy = sum(d for t, d in steps if ends[0] < t <= ends[-1])
            row |= {"steps_per_min": round(60 * (len(ends) - 1) / (ends[-1] - ends[0]), 2),
                    "wait_share": round(sum(d for t, d in waits if ends[0] < t <= ends[-1]) / busy, 3)}
        out.append(row)
    joins = []
    for j, since in zip(joined, registered[1:], strict=False):
        after = [round(d, 2) for t, d in steps if t > since][:4]
        joins.append({"gpu": j["gpu"], "after_step": j["after_step"], "launch_to_register_s":
                      round(since - j["launched"], 1), "next_steps_s": after})
    one = out[0].get("steps_per_min") if out else None
    for row in out:
        if one and row.get("steps_per_min"):
            row["speedup_vs_1"] = round(row["steps_per_min"] / one, 2)
    return {"by_generators": out, "joins": joins}


def shape_sets(args) -> list[str]:
    """The generation-heavy workload's overrides (--shape), its model and prompts built once."""
    if not args.shape:
        return []
    model = build_model(args.shape, MODELS / f"q-{args.shape}")
    data = write_dataset(MODELS / "prompts-32.jsonl", prompt_tokens=32)
    return [f"model.path={model}", f"data.path={data}", "data.chat_template=false", "data.system_prompt=null",
            'rewards=[{fn: "bench.common:parity_reward"}]', "sampling.max_tokens=1024", "sampling.ignore_eos=true",
            "generator.max_model_len=1088", "eval.every=0"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu-smollm2-math.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the rates")
    p.add_argument("--timeout", type=float, default=280, help="seconds per wave")
    p.add_argument("--first-timeout", type=float, default=None,
                   help="seconds for the first wave (default --timeout): a fresh machine's first run builds its caches")
    p.add_argument("--wave", action="append", required=True, help="jobs that run side by side (see above)")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench-runs/busy"))
    p.add_argument("--name", default="", help="added to the result's name")
    p.add_argument("--join", action="append", default=[], metavar="NAME:GPU@STEP",
                   help="a `pipeline generator` on GPU joins job NAME once it trained STEP steps")
    p.add_argument("--settle", type=int, default=2, help="steps after a registration left out of its phase")
    p.add_argument("--shape", default=None, help="0.5b or 1.5b: the generation-heavy workload (above)")
    args = p.parse_args()
    args.shape_sets = shape_sets(args)
    for spec in " ".join(args.wave).split():  # every job's form checked before the first wave starts
        job_argv(spec, args)
    results = {}
    args.first_timeout = args.first_timeout or args.timeout
    for i, specs in enumerate(args.wave):
        results.update(wave(specs.split(), args, first=i == 0))
        name = result_name("busy", Path(args.config).stem, args.name)
        write_result(name, "python -m bench.busy " + " ".join(sys.argv[1:]), args.config, results, quiet=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
