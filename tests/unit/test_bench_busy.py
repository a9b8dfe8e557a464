"""bench/busy.py's jobs: a job whose form is wrong is refused before the first wave starts (a GPU call once ran two
waves, then died on a third job named `et:0`, and its last waves never ran); an offline engine's job takes the run's
overrides, so it measures the engine the runs beside it build; a phase's rate leaves out the run's tail."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.busy import job_argv, phases
from tests.conftest import REPO

ARGS = SimpleNamespace(out=Path("/tmp/busy-test"), config="configs/gpu-smollm2-math.yaml", shape_sets=[], steps=5)


def test_an_engine_job_passes_its_overrides_to_the_offline_engine():
    name, argv, sets = job_argv("engine_nc:1::generator.compile=false;sampling.max_tokens=64", ARGS)
    assert name == "engine_nc" and sets == ["CUDA_VISIBLE_DEVICES=1", "generator.compile=false",
                                            "sampling.max_tokens=64"]
    assert argv[argv.index("--rounds") + 2:] == ["--set", "generator.compile=false", "--set", "sampling.max_tokens=64"]
    assert "--set" not in job_argv("engine:0", ARGS)[1]


@pytest.mark.parametrize("spec", ["et:0", "k1"])
def test_a_run_job_without_generator_gpus_is_refused_with_the_form(spec):
    with pytest.raises(SystemExit, match="names no generator GPUs: NAME:LEARNER_GPU:GENERATOR_GPUS"):
        job_argv(spec, ARGS)


def test_a_wrong_job_in_a_later_wave_stops_the_command_before_any_wave_runs(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench.busy", "--out", str(runs), "--timeout", "5",
                           "--wave", "k1:0:0", "--wave", "et:0"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "BENCH_RESULTS": str(results)})
    assert proc.returncode != 0 and "job 'et:0' names no generator GPUs" in proc.stderr
    assert not runs.exists() and not results.exists()  # the first wave's run never started, no result was written


def test_the_last_phase_leaves_out_the_steps_trained_after_generation_ended(tmp_path):
    """The phase with the most generators runs to the end of the run: its last k steps, trained from batches generated
    ahead with nothing generating beside them (3 s against 6 s here), are not its rate."""
    def span(name, pid, ts, dur, **args):
        return {"name": name, "ph": "X", "pid": pid, "tid": 1, "ts": int(ts * 1e6), "dur": int(dur * 1e6), "args": args}

    meta = [{"name": "thread_name", "ph": "M", "pid": 10, "tid": 1, "args": {"name": "learner"}},
            {"name": "thread_name", "ph": "M", "pid": 20, "tid": 1, "args": {"name": "g0"}}]
    steps = [span("step", 10, 6 * i, 6, step=i) for i in range(10)]
    steps += [span("step", 10, 60 + 3 * i, 3, step=10 + i) for i in range(2)]
    generate = [span("generate", 20, 5 * i, 5, tokens=100) for i in range(12)]  # the last ends at 60 s, as step 9
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": meta + steps + generate}))
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "register", "time": 0.5}) + "\n")

    row = phases(tmp_path, launched=0.0, joined=[], settle=1)["by_generators"][0]

    assert row["steps"] == 9 and row["steps_per_min"] == 10.0  # steps 0-9 ended 6 s apart (with the tail: 11.0)
