"""A standalone `pipeline generator`'s supervisor: the process the user started, when no `Child` started it.

`pipeline run`'s generators (and the tests' services) are started by `pipeline.launcher.Child`, which gives each a
guard and marks its environment (`GUARDED`). A generator started by hand, from a shell or a job script, has no guard:
killed with SIGKILL (the OOM killer's way) it left vLLM's engine core (re-parented to init, holding its memory) and
Python's resource tracker running. So `pipeline/entrypoints/generator.py` calls `supervise`, before anything
heavy is imported, and this process becomes a small supervisor:

- it starts the real generator (the same command line) as a `Child`, in a session of its own, its output on this
  process's stdout and stderr, with a guard that ends the child's process group (engine core, workers) once the
  child or this process is gone, however it went, then removes the /dev/shm files of dead processes (`guard`);
- SIGINT and SIGTERM are forwarded to the generator one for one: its session is out of reach of a terminal's Ctrl-C,
  and its own semantics stay (the first signal drains, the second leaves at once); any other end of this process
  (SIGKILL, SIGHUP) is the guard's to clean up after;
- it waits for the generator and its group, and exits with the generator's exit code (128 + N after signal N).
"""

from __future__ import annotations

import signal

from pipeline.environment import env_flag
from pipeline.launcher import GUARDED, Child, stop_all


def guarded() -> bool:
    """Started by `Child`: a guard ends this process's group should it die."""
    return env_flag(GUARDED) == "1"


def supervise(argv: list[str]) -> int:
    """Run `argv` (the generator's command line) as a guarded child until it ends; its exit code."""
    child = Child("generator", argv, None)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: child.proc.send_signal(signum))
        code = child.proc.wait()
    finally:  # the rest of its group ends (else is killed), its guard sweeps /dev/shm; on an error here, it leaves
        stop_all([child], now=True)
    return code if code >= 0 else 128 - code
