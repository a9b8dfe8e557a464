"""run.mps (pipeline/mps.py) with a stand-in `nvidia-cuda-mps-control` (tests/integration/mps_control.py): the
daemon starts with a pipe directory of the run's, is told `quit` once its clients are gone, is stopped by its PID when
it does not leave, and leaves no pipe directory; a machine where it cannot start is refused at start. The real daemon:
tests/gpu/test_gpu_mps.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline import host
from pipeline.config import load_config
from pipeline.launcher import Child
from pipeline.mps import PIPE, Mps, check_mps, under_mps
from pipeline.validate import ConfigError
from tests.conftest import running
from tests.integration.mps_control import stub_control


@pytest.fixture
def stub_path(tmp_path, monkeypatch):
    """PATH with the stand-in daemon first, and no MPS daemon of the caller's in the environment."""
    monkeypatch.setenv("PATH", f"{stub_control(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE, raising=False)
    monkeypatch.delenv("MPS_STUB", raising=False)


def _control_log(run_dir) -> list[str]:
    return (run_dir / "logs" / "mps" / "control.log").read_text().splitlines()


def test_the_daemon_serves_the_run_and_is_told_to_quit_once_its_clients_are_gone(tmp_path, stub_path):
    run_dir = tmp_path / "run"
    mps = Mps(run_dir)
    env = mps.start(Child)
    daemon = mps.daemon
    assert daemon is not None and running(daemon.pid)
    pipe = mps.pipe
    assert env[PIPE] == str(pipe) and pipe.name == f"pipeline-mps-{os.getpid()}"
    assert pipe.stat().st_mode & 0o777 == 0o700 and (pipe / "control").exists()
    # a client of the run's environment finds the daemon (its command reaches it)
    client = subprocess.run(["nvidia-cuda-mps-control"], input=b"get_server_list\n", env=env, timeout=30)
    assert client.returncode == 0
    mps.stop()
    assert not running(daemon.pid) and daemon.proc.returncode == 0  # it left by itself: told, not killed
    assert _control_log(run_dir) == [f"start pid {daemon.pid} pipe {pipe}", "command get_server_list",
                                      "command quit", "quit"]
    assert not pipe.exists()
    mps.stop()  # twice: nothing left to do


def test_a_daemon_that_does_not_quit_is_stopped_by_its_pid(tmp_path, stub_path, monkeypatch, capsys):
    monkeypatch.setenv("MPS_STUB", "stuck")
    run_dir = tmp_path / "run"
    mps = Mps(run_dir)
    mps.start(Child)
    daemon = mps.daemon
    assert daemon is not None
    mps.stop(grace=1.0)
    assert not running(daemon.pid) and daemon.proc.returncode == -15  # SIGTERM, by its PID
    assert "command quit" in _control_log(run_dir) and "quit" not in _control_log(run_dir)
    said = capsys.readouterr().out
    assert f"the control daemon (pid {daemon.pid}) did not quit within 1 s; stopping it by its PID" in said
    assert not mps.pipe.exists()


def test_a_daemon_that_fails_at_start_is_a_clear_error_and_leaves_nothing(tmp_path, stub_path, monkeypatch):
    monkeypatch.setenv("MPS_STUB", "fail")
    mps = Mps(tmp_path / "run")
    with pytest.raises(RuntimeError, match=r"run.mps: the CUDA MPS control daemon \(nvidia-cuda-mps-control -f\) "
                                           r"exited with 3(.|\n)*stub: failing at start"):
        mps.start(Child)
    assert mps.daemon is None and not mps.pipe.exists()


def test_run_mps_is_refused_at_start_where_its_daemon_cannot_start(tmp_path, monkeypatch):
    cfg = load_config(None, ["run.mps=true"])
    monkeypatch.delenv(PIPE, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control
    with pytest.raises(ConfigError, match="run.mps: true, but nvidia-cuda-mps-control is not on PATH .* set run.mps "
                                          "false"):
        check_mps(cfg)
    monkeypatch.setenv("PATH", f"{stub_control(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    check_mps(cfg)  # the daemon is there
    monkeypatch.setenv(PIPE, "/tmp/nvidia-mps")
    with pytest.raises(ConfigError, match="CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps is set: an MPS daemon of yours"):
        check_mps(cfg)
    assert under_mps()
    check_mps(load_config(None, []))  # run.mps false: nothing is asked of the machine


@pytest.mark.parametrize("learner, generators, refused", [
    ("0", ["1"], True), ("0,1", ["2", "3"], True), ("0", ["1", "2,3"], True),  # a GPU each: MPS would change nothing
    ("0", ["0"], False), ("0", ["1", "1"], False), ("0,1", ["1"], False),  # a GPU shared: its kernels run together
])
def test_run_mps_where_no_gpu_is_shared_is_refused_as_a_knob_that_would_not_act(learner, generators, refused,
                                                                                tmp_path, monkeypatch):
    monkeypatch.delenv(PIPE, raising=False)
    monkeypatch.setenv("PATH", f"{stub_control(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    cfg = load_config(None, ["run.mps=true", "generator.gpu_memory_utilization=0.3", f"run.learner_gpus='{learner}'",
                             f"run.generators={len(generators)}", f"run.generator_gpus={json.dumps(generators)}"])
    if refused:
        with pytest.raises(ConfigError, match=rf"run.mps: true, but each GPU holds one of the run's processes \(the "
                                              rf"learner on '{learner}'.*Set run.mps false, or put a generator"):
            check_mps(cfg)
    else:
        check_mps(cfg)


def test_pipeline_run_refuses_run_mps_without_the_daemon_before_it_starts_anything(tmp_path, monkeypatch, capsys):
    from pipeline.entrypoints.cli import main

    monkeypatch.delenv(PIPE, raising=False)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), "--set", "run.mps=true"]) == 2
    said = capsys.readouterr().err
    assert "pipeline: config error: run.mps: true, but nvidia-cuda-mps-control is not on PATH" in said
    assert not run_dir.exists()


def test_the_pipe_directory_of_a_launcher_killed_with_sigkill_is_removed_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "SHM_ROOT", tmp_path / "shm")
    monkeypatch.setattr(host.tempfile, "gettempdir", lambda: str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pipe = host.private_dir(tmp_path / f"pipeline-mps-{dead.stdout.strip()}")
    (pipe / "owner").write_text(dead.stdout.strip())
    (pipe / "control").write_bytes(b"")
    (pipe / "log").mkdir()  # a folder of the daemon's in it
    (pipe / "log" / "control.log").write_text("x")
    assert host.remove_stale() == [pipe] and not pipe.exists()


def test_a_launcher_killed_with_sigkill_leaves_no_daemon_and_no_pipe_directory(tmp_path, stub_path):
    """The daemon is a `Child`: its guard stops it once its starter is gone, however it went, and sweeps the starter's
    pipe directory (remove_stale: its owner is dead)."""
    import re
    import signal

    from tests.conftest import wait_for

    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from pipeline.launcher import Child; "
         "from pipeline.mps import Mps; Mps(Path(sys.argv[1])).start(Child); time.sleep(600)", str(tmp_path / "run")],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = starter.stdout.readline() if starter.stdout else ""
        said = re.match(r"CUDA MPS: control daemon pid (\d+), pipe (\S+),", line)
        assert said, line
        daemon, pipe = int(said[1]), said[2]
        assert running(daemon) and os.path.isdir(pipe) and pipe.endswith(f"pipeline-mps-{starter.pid}")
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        wait_for(lambda: not running(daemon) and not os.path.exists(pipe), 60, "the daemon stopped, its pipe gone")
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
