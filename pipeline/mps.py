"""CUDA MPS under `pipeline run` (run.mps): one control daemon of the run's, whose clients are the learner and the
generators.

Without MPS, processes on one GPU take turns on it by time slices: an engine's decode steps and the learner's kernels
never run at once. Under MPS one server holds the GPU's context for every client, and their kernels may run together.
The daemon is NVIDIA's `nvidia-cuda-mps-control`, run in the foreground (`-f`) as a child of the launcher (a `Child`,
stopped by its PID; its guard ends it if the launcher dies), with a pipe directory of its own
(/tmp/pipeline-mps-PID, the launcher's PID: not the machine's /tmp/nvidia-mps, nor another run's) and its logs in
RUN_DIR/logs/mps/. The children find it by CUDA_MPS_PIPE_DIRECTORY in their environment. Once they are gone the daemon
is told `quit` (it ends its server); one that does not leave is stopped by its PID, and the pipe directory removed.

A run under MPS says so in each record (`mps`, `under_mps`), and the verdict reads it: a learner-bound run whose
engines share the learner's GPU without MPS is told of `run.mps`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.host import private_dir, remove_dir
from pipeline.validate import ConfigError

CONTROL = "nvidia-cuda-mps-control"
PIPE = "CUDA_MPS_PIPE_DIRECTORY"


def under_mps() -> bool:
    """Whether this process is a CUDA MPS client: an MPS daemon's pipe directory is in its environment."""
    return bool(os.environ.get(PIPE))


def check_mps(cfg) -> None:
    """run.mps where it would not act (each GPU holds one of the run's processes), on a machine where `pipeline run`
    cannot start its daemon, or where one serves the environment already: refused at start, with the way on."""
    if not cfg.run.mps:
        return
    placed = [cfg.run.learner_gpus, *(cfg.run.gpus_of(i) for i in range(cfg.run.generators))]
    if None not in placed and max(Counter(g for gpus in placed for g in str(gpus).split(",")).values()) == 1:
        raise ConfigError(f"run.mps: true, but each GPU holds one of the run's processes (the learner on "
                          f"{cfg.run.learner_gpus!r}, its generators on {placed[1:]}): MPS lets processes that share a "
                          "GPU run their kernels at once, and here none share one. Set run.mps false, or put a "
                          "generator on the learner's GPU (run.generator_gpus)")
    if os.environ.get(PIPE):
        raise ConfigError(f"run.mps: true, but {PIPE}={os.environ[PIPE]} is set: an MPS daemon of yours serves this "
                          "environment already, and the run's processes are its clients. Set run.mps false, or unset "
                          f"{PIPE} to let the run start its own")
    if shutil.which(CONTROL) is None:
        raise ConfigError(f"run.mps: true, but {CONTROL} is not on PATH (NVIDIA's driver utilities ship it; CUDA MPS "
                          "needs an NVIDIA GPU). Install them, or set run.mps false")


class Mps:
    """The run's MPS control daemon: `start` it before the learner and the generators, `stop` it after them."""

    def __init__(self, run_dir: Path):
        self.pipe = Path(tempfile.gettempdir()) / f"pipeline-mps-{os.getpid()}"  # short: the daemon's sockets are in it
        self.logs = run_dir / "logs" / "mps"
        self.env: dict[str, str] = {}
        self.daemon: Any = None  # a pipeline.launcher.Child

    def start(self, child: Callable[..., Any], timeout: float = 30.0) -> dict[str, str]:
        """Start the daemon with `child` (pipeline.launcher.Child, which imports this module) and wait for its control
        socket; the environment of its clients (this one's, with the pipe directory). RuntimeError, with its log, if
        it does not come up."""
        private_dir(self.pipe)  # 0700, its owner named: a launcher killed with SIGKILL leaves it to remove_stale
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, PIPE: str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}
        self.daemon = daemon = child("mps", [CONTROL, "-f"], self.logs / "daemon.log", env=self.env)
        deadline = time.monotonic() + timeout
        while not (self.pipe / "control").exists():
            if daemon.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {daemon.proc.returncode}" if daemon.proc.poll() is not None
                       else f"did not open {self.pipe / 'control'} within {timeout:g} s")
                self.stop()
                raise RuntimeError(f"run.mps: the CUDA MPS control daemon ({CONTROL} -f) {why}; its log "
                                   f"({self.logs}):\n{daemon.tail()}")
            time.sleep(0.1)
        print(f"CUDA MPS: control daemon pid {daemon.pid}, pipe {self.pipe}, logs in {self.logs}", flush=True)
        return self.env

    def stop(self, grace: float = 30.0) -> None:
        """Tell the daemon `quit` (it ends its server; the clients are gone by now); stop it by its PID if it has not
        left within `grace` seconds. Then its pipe directory goes."""
        daemon = self.daemon
        if daemon is not None:
            if daemon.proc.poll() is None:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    subprocess.run([CONTROL], input=b"quit\n", env=self.env, capture_output=True, timeout=10)
                try:
                    daemon.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    print(f"CUDA MPS: the control daemon (pid {daemon.pid}) did not quit within {grace:g} s; stopping "
                          "it by its PID", flush=True)
            daemon.stop(grace=5.0)  # its log closed, its guard gone; by its PID if it is still there
            self.daemon = None
        remove_dir(self.pipe)
