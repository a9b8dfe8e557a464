"""bench/busy.py's jobs: a job whose form is wrong is refused before the first wave starts (a GPU call once ran two
waves, then died on a third job named `et:0`, and its last waves never ran); an offline engine's job takes the run's
overrides, so it measures the engine the runs beside it build."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.busy import job_argv
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
