"""A named run, killed and started again, with real processes (`pipeline run`: a DeepSpeed learner on CPU, a vLLM
generator): a SIGKILLed `pipeline run` leaves no process and no /dev/shm file; running the same name again is
refused with the ways on, leaving the run's files as they were; `pipeline run --resume` finishes it with every
prompt of each epoch trained exactly once; the finished run is refused again. Asserts outcomes, never times."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.conftest import REPO, running, wait_for
from tests.integration.helpers import descendants, held_at

pytestmark = pytest.mark.integration

PROMPTS, BATCH, EPOCHS = 32, 4, 2
STEPS = PROMPTS * EPOCHS // BATCH  # the run ends when both epochs are trained


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _checkpoint(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text()[1:]) if latest.exists() else 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_a_killed_named_run_leaves_nothing_is_refused_again_and_resumes_exactly_once(procs, tmp_path, model_cache):
    run_dir = tmp_path / "again"
    again = ["run", "--set", f"run.dir={tmp_path}", "--set", "run.name=again"]
    settings = [f"data.size={PROMPTS}", f"trainer.batch_size={BATCH}", "trainer.group_size=4",
                f"trainer.epochs={EPOCHS}", f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=3",
                "run.tensorboard=false", "weights.transport=shm"]
    # the learner stops after step 5, past the checkpoint of version 3, and waits to be killed: on a fast machine a
    # poll for "a step past a checkpoint" once missed all 16 steps (pipeline/environment.py held_at_step)
    # the generator's engine core spawned (VLLM_WORKER_MULTIPROC_METHOD), as a generator's later engines are: its
    # shared-memory segments, which a forked core does not make, must go too
    first = procs(again + [a for s in settings for a in ("--set", s)], tmp_path / "first.log",
                  env={**held_at(5), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    wait_for(lambda: _checkpoint(run_dir) == 3 and len(read_jsonl(run_dir / "metrics.jsonl")) == 5, 600,
             "the run held after its fifth step", [first])
    services = descendants(first.pid)  # learner, generator, its engine core and worker, the guards
    hub = json.loads((run_dir / "hub.json").read_text())
    generator = next(p for p, cmd in services if "-m pipeline generator" in cmd)
    receiver = Path(f"/dev/shm/pipeline-recv-{generator}")
    shm = [Path(f"/dev/shm/pipeline-{hub['run_id']}"), receiver]
    shm += [Path("/dev/shm") / name for name in (receiver / "segments").read_text().split()]
    assert all(p.exists() for p in shm), shm

    os.kill(first.pid, signal.SIGKILL)  # or the OOM killer: it cannot stop its children itself
    try:
        wait_for(lambda: not [p for p, _ in services if running(p)], 120, "every process of the run to end", [])
        assert not (run_dir / "final").exists(), "the learner trained on to the end after `pipeline run` was killed"
    finally:
        for pid, _ in services:  # a failed check must not leave them running: by PID
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30  # seconds: processes that ended remove their files as they go, or the guards do
    while [p for p in shm if p.exists()] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not [p for p in shm if p.exists()], f"left in /dev/shm: {[p for p in shm if p.exists()]}"

    for state in ("not finished", "finished"):
        before = _files(run_dir)
        refused = _cli(*again)
        assert refused.returncode == 2, refused.stderr
        steps = len(read_jsonl(run_dir / "metrics.jsonl"))
        assert (f"{run_dir} holds a run already ({steps} steps done, newest checkpoint v{_checkpoint(run_dir)}, "
                f"{state})") in refused.stderr
        assert f"pipeline run --resume {run_dir}" in refused.stderr and "run.name=NEW_NAME" in refused.stderr
        assert _files(run_dir) == before
        if state == "not finished":
            resumed = procs(["run", "--resume", str(run_dir)], tmp_path / "resumed.log")  # with the run's config
            assert resumed.wait(600) == 0, resumed.tail()

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    trained = [(t[0], t[1]) for r in records for t in r["trained"]]
    assert sorted(trained) == [(epoch, p) for epoch in range(EPOCHS) for p in range(PROMPTS)]  # each exactly once
