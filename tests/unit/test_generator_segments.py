"""The vLLM engine's shared-memory segments: told from another engine's, and removed when the generator exits even
where the engine's processes could not unlink them (weights/files.py: `own_segments`, `mapped_segments`,
`remove_left_segments`, as generator/service.py uses them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.host import mapped_segments, remove_left_segments

# makes a segment and a semaphore as vLLM's processes do, untracked (as when its resource tracker dies with it), and
# holds them until killed
MAKER = """
import multiprocessing as mp, sys, time
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister("/" + shm.name, "shared_memory")
lock = mp.get_context("spawn").Lock()
name = lock._semlock.name
resource_tracker.unregister(name, "semaphore")
print(shm.name, "sem." + name.lstrip("/"), flush=True)
time.sleep(600)
"""


def _maker() -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().split()


def test_an_engines_segments_are_its_own_and_go_when_no_live_process_maps_them():
    ours, mine = _maker()  # as this generator's engine
    other, theirs = _maker()  # as an engine starting beside it
    try:
        assert all(Path(f"/dev/shm/{n}").exists() for n in mine + theirs)
        # by inode: the semaphore is mapped under the temporary name it was made with
        assert mapped_segments(mine + theirs, {ours.pid}) == sorted(mine)
        os.kill(ours.pid, signal.SIGKILL)  # the engine dies without unlinking anything
        ours.wait()
        remove_left_segments(mine + theirs)
        assert not [n for n in mine if Path(f"/dev/shm/{n}").exists()]
        assert all(Path(f"/dev/shm/{n}").exists() for n in theirs)  # still mapped by a live process: not ours
    finally:
        for p in (ours, other):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        for n in mine + theirs:
            Path(f"/dev/shm/{n}").unlink(missing_ok=True)
