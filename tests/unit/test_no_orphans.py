"""No process outlives the one that started it: a child's process group (vLLM's engine processes are in a
generator's) ends when the child dies, and when its starter dies (a SIGKILLed `pipeline run`, a pytest session a CI
time-out ends with SIGTERM). Stand-in children (`sh`, `sleep`), watched and stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


def test_learner_ranks_leave_no_folder_of_torchruns_agent_in_the_temp_folder(tmp_path):
    """Two ranks under torchrun's agent (learner/launch.py `run_ranks`), each failing at once on a bad argument: the
    first failed rank's exit code comes back, and nothing is left in the temp folder (torchrun's agent made a
    torchelastic_* folder there at each start and left it)."""
    code = "import sys; from learner.launch import run_ranks; sys.exit(run_ranks(['learner', '--no-such-flag'], 2))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "no-such-flag" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], out.stderr[-3000:]


STUCK_RANK = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist
from learner import service
from weights.files import shm_dir
from pipeline.host import private_dir

rank, run_id = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
if rank == 1:  # a rank that no longer answers: it never joins the all-reduce
    time.sleep(600)
signal.signal(signal.SIGTERM, service._terminate)
service.end_if_stuck(run_id, grace_s=2.0)
private_dir(shm_dir(run_id))
print("ready", flush=True)
dist.all_reduce(torch.zeros(1))  # waits in gloo for rank 1: Python's SIGTERM handler cannot run
"""


def test_a_rank_stuck_in_a_collective_ends_on_sigterm_and_removes_its_shm_files(tmp_path):
    """A rank whose collective waits for a rank that is gone cannot run Python's SIGTERM handler until the collective
    times out (trainer.rank_timeout_s); learner.service.end_if_stuck ends it within its grace, its /dev/shm files
    removed, before torchrun's agent would SIGKILL it with the files left."""
    from pipeline.netutil import reserved_port
    from weights.files import shm_dir

    run_id, port = f"stuck-{os.getpid()}", str(reserved_port())
    ranks = [subprocess.Popen([sys.executable, "-c", STUCK_RANK, str(r), run_id, port], stdout=subprocess.PIPE,
                              text=True, cwd=REPO) for r in (0, 1)]
    try:
        assert ranks[0].stdout.readline() == "ready\n"
        assert shm_dir(run_id).is_dir()
        time.sleep(1.0)  # in the all-reduce
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(30) == 130
        assert not shm_dir(run_id).exists()
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait(10)


STANDIN_GENERATOR = """
import os, signal, subprocess, sys, time
from pipeline.environment import env_flag

engine = subprocess.Popen(["sleep", "600"])  # its engine core, in its process group
got = []
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: got.append(signum))
print(f"guarded={env_flag('PIPELINE_GUARDED')}", os.getpid(), engine.pid, flush=True)
seen = 0
while seen < 2:  # each signal as it comes
    time.sleep(0.05)
    if len(got) > seen:
        seen = len(got)
        print(*got, flush=True)
sys.exit(3)
"""
SUPERVISOR = "import sys; from pipeline.supervise import supervise; sys.exit(supervise(sys.argv[1:]))"


def test_a_standalone_generators_supervisor_forwards_signals_one_for_one_and_exits_with_its_code():
    """`pipeline generator` started by hand runs as a supervisor (pipeline/supervise.py) of the real one, which is in
    a session of its own with a guard: each SIGINT or SIGTERM the supervisor gets (a terminal's Ctrl-C, `kill`) is the
    real generator's (the first drains it, the second makes it leave), and the supervisor exits with its code."""
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, sys.executable, "-c", STANDIN_GENERATOR],
                           stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    child = engine = 0
    try:
        marker, child, engine = sup.stdout.readline().split()
        child, engine = int(child), int(engine)
        assert marker == "guarded=1"  # it knows it is guarded: it does not supervise itself again
        assert os.getsid(child) == child != sup.pid  # out of reach of the terminal's Ctrl-C
        sup.send_signal(signal.SIGINT)
        assert sup.stdout.readline().split() == [str(int(signal.SIGINT))]
        sup.send_signal(signal.SIGTERM)
        assert sup.stdout.readline().split() == [str(int(signal.SIGINT)), str(int(signal.SIGTERM))]
        assert sup.wait(30) == 3
        assert not running(engine)  # its group ended before the supervisor did
    finally:
        for pid in (sup.pid, child, engine):
            if pid and running(pid):
                os.kill(pid, signal.SIGKILL)
        sup.wait(30)
