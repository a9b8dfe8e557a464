"""Several learner ranks on one host: the `pipeline learner` process spawns one child per rank.

Each child gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and, on GPUs, sees only
its own GPU (CUDA_VISIBLE_DEVICES), so no rank allocates on another's device. Rank 0 serves the hub.
Signals to the parent are passed on; when one rank fails, the others are stopped (by PID). A rank gets SIGTERM
when the parent dies (a parent-death signal), so none outlives it, even after a SIGKILL or the OOM killer.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from pipeline.netutil import free_port


def world_size(ranks: int, gpus: str | None) -> int:
    if ranks:
        return ranks
    return len(gpus.split(",")) if gpus else 1


def spawn_ranks(argv: list[str], world: int, gpus: str | None) -> int:
    """Run `pipeline.cli *argv` once per rank; returns the exit code (a failed rank's, if any)."""
    port = str(free_port())
    command = [sys.executable, "-m", "pipeline.cli", *argv]
    end_with_me = _parent_death_signal(os.getpid())
    return supervise([subprocess.Popen(command, env=rank_env(rank, world, gpus, port), preexec_fn=end_with_me)
                      for rank in range(world)])


def _parent_death_signal(parent: int):
    """A preexec_fn: the child gets SIGTERM (a rank ends as on Ctrl-C, removing its files) once the thread that
    started it is gone; this one, the main thread, lives as long as the parent process."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def rank_env(rank: int, world: int, gpus: str | None, port: str) -> dict:
    """The environment of one rank: the torch.distributed variables and, on GPUs, its own GPU alone."""
    devices = gpus.split(",") if gpus else None
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0" if devices else str(rank),
           "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices[rank % len(devices)]
    return env


def supervise(children: list[subprocess.Popen]) -> int:
    """Pass SIGTERM and SIGINT on to the ranks and wait for them all; when one fails, kill the others (by PID)."""

    def forward(sig, _frame):
        for c in children:
            if c.poll() is None:
                c.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [c.poll() for c in children]
        if all(code is not None for code in codes):
            return max(codes, key=abs)
        if any(code not in (None, 0) for code in codes):
            for c in children:  # one rank failed: the collectives of the others would hang
                if c.poll() is None:
                    c.kill()
        time.sleep(0.2)
