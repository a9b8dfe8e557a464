"""Shared fixtures: free ports, a per-session model cache, processes tracked and stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.netutil import free_port as _free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def free_port() -> int:
    return _free_port()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Tests build the tiny model into their own cache, never the user's."""
    d = tmp_path_factory.mktemp("model-cache")
    os.environ["PIPELINE_CACHE"] = str(d)
    return d


class Proc:
    """A child in its own process group; stopped by PID (never by name)."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._f = log.open("ab")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, **(env or {})}, cwd=REPO)

    @property
    def pid(self) -> int:
        return self.p.pid

    def signal(self, sig: int) -> None:
        if self.p.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.p.wait(timeout)

    def stop(self, grace: float = 20) -> None:
        if self.p.poll() is None:
            self._group(signal.SIGTERM)
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self._group(signal.SIGKILL)  # the whole group: vLLM's engine core too
        if self.p.poll() is None:
            self.p.wait(10)
        self._f.close()

    def _group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(args: list[str], log: Path, env: dict | None = None) -> Proc:
        p = Proc([sys.executable, "-m", "pipeline.cli", *args], log, env)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.stop()


def wait_for(predicate, timeout: float, what: str, procs_to_check: list[Proc] = ()):
    """Poll `predicate` until it returns a truthy value; fail with the logs of `procs_to_check`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs_to_check:
            if p.p.poll() is not None and p.p.returncode != 0:
                pytest.fail(f"{what}: process {p.pid} exited with {p.p.returncode}:\n{p.tail()}")
        time.sleep(0.3)
    logs = "\n\n".join(p.tail() for p in procs_to_check)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{logs}")
