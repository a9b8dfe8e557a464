"""`pipeline run --set run.mps=true` on CPU, with the stand-in MPS daemon (tests/integration/mps_control.py) first on
PATH: the learner and the generator run in its environment (every record says `mps`), the daemon is told `quit` once
they are gone and leaves, and no pipe directory is left. NVIDIA's daemon under a GPU run: tests/gpu/test_gpu_mps.py."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.conftest import running
from tests.integration.mps_control import stub_control

pytestmark = pytest.mark.integration

STEPS = 4


def test_pipeline_run_under_run_mps_is_a_client_of_its_daemon_and_stops_it(procs, tmp_path, model_cache):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{stub_control(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}"}
    run = procs(["run", "--run-dir", str(run_dir), "--set", f"trainer.total_steps={STEPS}", "--set", "run.mps=true"],
                tmp_path / "run.log", env)
    assert run.wait(600) == 0, run.tail()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["mps"] for r in records] == [True] * STEPS  # the learner ran in the daemon's environment
    pipe = Path(tempfile.gettempdir()) / f"pipeline-mps-{run.pid}"
    said = re.search(r"^CUDA MPS: control daemon pid (\d+), pipe (\S+), logs in (\S+)$", run.tail(200), re.M)
    assert said and said[2] == str(pipe) and said[3] == str(run_dir / "logs" / "mps"), run.tail()
    daemon = int(said[1])
    log = (run_dir / "logs" / "mps" / "control.log").read_text().splitlines()
    assert log == [f"start pid {daemon} pipe {pipe}", "command quit", "quit"], log  # told once, and it left
    assert not running(daemon) and not pipe.exists()
    for child in ("learner", "generator-0"):  # both started in the daemon's environment, and say so
        child_log = (run_dir / "logs" / f"{child}.log").read_text()
        assert f"CUDA MPS: a client of the daemon at CUDA_MPS_PIPE_DIRECTORY={pipe}" in child_log, child
