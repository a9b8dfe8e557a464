"""No process outlives the one that started it: a child's process group (vLLM's engine processes are in a
generator's) ends when the child dies, and when its starter dies (a SIGKILLed `pipeline run`, a pytest session a CI
time-out ends with SIGTERM). Stand-in children (`sh`, `sleep`), watched and stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from pipeline.launcher import Child, _members
from tests.conftest import REPO, running, wait_for


def _kill(pids: list[int], group: int) -> None:
    """Clean up after a failed check: what is still in `group`, by PID."""
    for pid in pids:
        if pid in _members(group):
            os.kill(pid, signal.SIGKILL)


def test_a_child_that_dies_takes_its_process_group_with_it(tmp_path):
    """A generator killed with SIGKILL (the OOM killer): its engine core, in its group, would run on holding memory."""
    child = Child("generator", ["sh", "-c", "sleep 600 & exec sleep 600"], tmp_path / "g.log")
    group = wait_for(lambda: (lambda m: m if len(m) == 2 else None)(_members(child.pid)), 30, "the group", [])
    try:
        os.kill(child.pid, signal.SIGKILL)  # the child alone; its "engine" (the other sleep) is not signalled
        wait_for(lambda: not _members(child.pid), 60, f"the rest of the group {group} to end", [])
    finally:
        _kill(group, child.pid)
        child.stop(grace=1)


INNER = """
import os
import time
from pathlib import Path

from tests.conftest import Proc


def test_runs_until_killed(tmp_path):
    proc = Proc(["sh", "-c", "sleep 600 & sleep 600 & wait"], tmp_path / "service.log")
    Path(os.environ["SERVICE_PID"]).write_text(str(proc.pid))
    time.sleep(600)
"""


def test_a_pytest_session_ended_with_sigterm_leaves_no_process_of_its_procs(tmp_path):
    """The fixture's Proc: its teardown never runs when pytest is killed, and its services live in sessions of their
    own, where a signal to pytest's group does not reach them."""
    (tmp_path / "test_inner.py").write_text(INNER)
    pid_file = tmp_path / "service.pid"
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                                str(tmp_path), str(tmp_path / "test_inner.py")], cwd=REPO,
                               env={**os.environ, "SERVICE_PID": str(pid_file)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    group, leader = [], 0
    try:
        leader = wait_for(lambda: pid_file.exists() and pid_file.read_text() and int(pid_file.read_text()), 60,
                          "the inner session's service", [])
        group = wait_for(lambda: (lambda m: m if len(m) == 3 else None)(_members(leader)), 30, "its group", [])
        session.send_signal(signal.SIGTERM)
        assert session.wait(30) == -signal.SIGTERM
        wait_for(lambda: not _members(leader), 60, f"the service's processes {group} to end", [])
    finally:
        if session.poll() is None:
            session.kill()
        _kill(group, leader)


RANKS_PARENT = """
import subprocess, sys, time

rank = subprocess.Popen([sys.executable, "-c", "from learner.launch import end_with_parent; end_with_parent(); "
                         "import time; print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE,
                        text=True, start_new_session=True)  # as torchrun starts a rank: out of reach of killpg
assert rank.stdout.readline() == "ready\\n"
print(rank.pid, flush=True)
time.sleep(600)
"""


def test_learner_ranks_end_when_their_parent_is_killed():
    """`pipeline learner` with several ranks (torchrun's agent), run without `pipeline run` (no guard) and killed
    with SIGKILL: a rank started in a session of its own ends too."""
    parent = subprocess.Popen([sys.executable, "-c", RANKS_PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO)
    rank = 0
    try:
        rank = int(parent.stdout.readline())
        parent.kill()
        parent.wait(30)
        wait_for(lambda: not running(rank), 30, f"rank {rank} to end", [])
    finally:
        if parent.poll() is None:
            parent.kill()
        if rank and running(rank):
            os.kill(rank, signal.SIGKILL)
