"""GPU: `pipeline run` of the shipped smollm2 config with run.mps (pipeline/mps.py). NVIDIA's MPS control
daemon starts with the run, the learner and both engines are clients of its server (nvidia-smi lists the server on
the GPU while the run goes on), every record says `mps`, and once the run ends no MPS process and no pipe directory is
left. On two GPUs, two learner ranks each beside an engine (issue 54's second setup) under one daemon whose server
holds both (not run yet: written when only one GPU was lent)."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.conftest import REPO, wait_for
from tests.gpu.helpers import gpu_count

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
    pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU"),
    pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="needs NVIDIA's MPS control daemon"),
]

STEPS = 12


def _mps_processes() -> list[str]:
    """This machine's MPS daemons and servers: 'PID PROGRAM' (from the command line: /proc/PID/comm cuts names to 15
    characters, "nvidia-cuda-mps" for both)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            name = Path(cmdline.read_bytes().split(b"\0")[0].decode(errors="replace")).name
        except OSError:
            continue
        if name.startswith("nvidia-cuda-mps"):
            found.append(f"{cmdline.parent.name} {name}")
    return found


def _run_under_mps(procs, tmp_path, sets: list[str], limit: float) -> tuple:
    """`pipeline run` of the smollm2 config under run.mps with `sets` (KEY=VALUE), to its end (exit 0 within `limit`
    s of its third step): (the run, its records, nvidia-smi and the MPS processes at its third step). Each record says
    `mps`, with a finite reward and both engines on the learner's GPUs; no MPS process or pipe directory is left."""
    assert not _mps_processes(), "an MPS daemon runs already: this test needs the machine's GPUs to itself"
    run_dir = tmp_path / "run"
    run = procs(["run", "-c", str(REPO / "configs/gpu-smollm2-math.yaml"), "--run-dir", str(run_dir),
                 "--set", "run.mps=true", "--set", f"trainer.total_steps={STEPS}", "--set", "sampling.max_tokens=128",
                 "--set", "eval.every=0", *(arg for kv in sets for arg in ("--set", kv))], tmp_path / "run.log")
    wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 3 if (run_dir / "metrics.jsonl").exists()
             else False, limit, "three steps", [run])
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
    during = _mps_processes()
    assert run.wait(limit) == 0, run.tail()
    print(smi)
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert all(r["mps"] is True for r in records)
    assert all(math.isfinite(r["reward/mean"]) for r in records)
    assert records[-1]["generators"] == 2 and records[-1]["generators_on_learner_gpus"] == 2
    assert not _mps_processes(), "left running"
    assert not list(Path(tempfile.gettempdir()).glob(f"pipeline-mps-{run.pid}")), "pipe directory left"
    return run, records, smi, during


def test_the_run_is_a_client_of_its_own_mps_daemon_and_leaves_none(procs, tmp_path):
    run, records, smi, during = _run_under_mps(procs, tmp_path, ["trainer.max_staleness=1"], 400)
    assert "nvidia-cuda-mps-server" in smi, smi  # the server holds the GPU for its clients
    assert any(p.endswith("nvidia-cuda-mps-control") for p in during), during
    assert [r["step"] for r in records] == list(range(STEPS))
    assert re.search(r"^CUDA MPS: control daemon pid \d+, pipe /\S+/pipeline-mps-\d+", run.tail(200), re.M)
    logs = tmp_path / "run" / "logs" / "mps"
    print(*sorted(p.name for p in logs.iterdir()))
    print((logs / "daemon.log").read_text()[-2000:])


def test_a_run_killed_with_sigkill_leaves_no_mps_process(procs, tmp_path):
    """SIGKILL to `pipeline run` under run.mps: the guards stop the learner, the engines and the daemon's group; the
    server the daemon started goes with it or once its clients are gone (checked here: not said by NVIDIA's docs)."""
    import signal

    assert not _mps_processes(), "an MPS daemon runs already: this test needs the machine's GPU to itself"
    run_dir = tmp_path / "run"
    run = procs(["run", "-c", str(REPO / "configs/gpu-smollm2-math.yaml"), "--run-dir", str(run_dir),
                 "--set", "run.mps=true", "--set", "trainer.total_steps=200", "--set", "eval.every=0"],
                tmp_path / "run.log")
    wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2 if (run_dir / "metrics.jsonl").exists()
             else False, 400, "two steps", [run])
    assert any(p.endswith("nvidia-cuda-mps-server") for p in _mps_processes()), _mps_processes()
    run.signal(signal.SIGKILL)
    wait_for(lambda: not _mps_processes(), 120, "no MPS process left")
    pipe = Path(tempfile.gettempdir()) / f"pipeline-mps-{run.pid}"
    wait_for(lambda: not pipe.exists(), 60, "the pipe directory gone")


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs (a learner rank and an engine on each)")
def test_two_learner_ranks_each_beside_an_engine_are_clients_of_one_daemon_on_both_gpus(procs, tmp_path):
    """Issue 54's second setup under run.mps: two nccl learner ranks, each with an engine on its GPU, all clients of
    the run's one daemon, whose server holds both GPUs; the ranks' all-reduce and the versions go on as without it."""
    _, records, smi, _ = _run_under_mps(procs, tmp_path, ["run.learner_gpus='0,1'", 'run.generator_gpus=["0", "1"]',
                                                          "trainer.max_staleness=2"], 500)
    served = {int(m[1]) for m in re.finditer(r"^\|\s+(\d+)\s+.*nvidia-cuda-mps-server", smi, re.M)}
    assert served == {0, 1}, smi  # one server, listed on each GPU it holds for its clients
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
