"""This host: who it is, its processes, and what they leave in /dev/shm.

`host_identity` tells the hub whether a generator shares the learner's machine and host (weights.pick). Private
folders (0700, files 0600: weights are not everyone's) name their owner process, so what a process killed with
SIGKILL left behind is removed by the next learner, generator or launcher (`remove_stale`), with the shared-memory
segments its vLLM engine made (`record_segments`) and the CUDA IPC files of a dead learner. `processes` reads
/proc: the launcher's process groups and the segments' mappings both come from it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path


def processes() -> dict[int, tuple[str, int, int]]:
    """{pid: (state, parent's pid, process group)} of every process, from /proc/PID/stat (state "Z": a zombie, exited
    and not reaped yet)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            state, ppid, pgid = _fields(stat)[:3]
            out[int(stat.parent.name)] = (state, int(ppid), int(pgid))
    return out


def _fields(stat: Path) -> list[str]:
    """/proc/PID/stat's fields after the command name, which may hold spaces and parentheses: state first."""
    return stat.read_text().rsplit(")", 1)[1].split()


SHM_ROOT = Path("/dev/shm")


def host_identity() -> tuple[str, str]:
    """(hostname, "BOOT_ID:NETNS:SHM"): the machine's boot id, this process's network namespace and the device of
    its /dev/shm. Processes of one boot id share a machine (its GPU numbers name the same devices); they share a
    host, whose /dev/shm files and CUDA IPC handles both can open, only when all three match. A process in a
    network namespace or with a /dev/shm of its own (a container; the tests' namespaces) is on another host, as
    the hub sees it: its transport is zmq, not shm (weights.pick)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname(), ""
    where = f"{boot}:{_inode('/proc/self/ns/net'):x}:{_inode('/dev/shm', device=True):x}"
    return socket.gethostname(), where[:64]  # P.Register.boot_id's limit (36 + 2 x 9 characters in practice)


def _inode(path: str, device: bool = False) -> int:
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return st.st_dev if device else st.st_ino


def private_dir(path: Path) -> Path:
    """A folder only this user can enter, with an `owner` file naming this process (see remove_stale)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    (path / "owner").write_text(str(os.getpid()))
    return path


def write_private(path: Path, data) -> None:
    """Write `data` to `path` atomically, readable by this user only (weights are not everyone's)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def remove_dir(d: Path) -> None:
    """Remove folder `d` and what is in it (an MPS daemon's pipe directory may hold folders); gone already: fine."""
    shutil.rmtree(d, ignore_errors=True)


def remove_stale() -> list[Path]:
    """Remove this user's pipeline folders in /dev/shm (and the temp folder) whose owner process is gone: a
    learner or generator killed with SIGKILL cannot clean up after itself; and the CUDA IPC files of dead
    processes (`CUDA_IPC`). Returns what was removed."""
    removed = []
    for root in {SHM_ROOT, Path(tempfile.gettempdir())}:
        for d in root.glob("pipeline-*") if root.is_dir() else []:
            try:
                if d.stat().st_uid != os.getuid() or not d.is_dir():
                    continue
                pid = int((d / "owner").read_text())
            except (OSError, ValueError):
                continue
            if not alive(pid):
                _remove_segments(d)
                remove_dir(d)
                removed.append(d)
    for f in SHM_ROOT.iterdir() if SHM_ROOT.is_dir() else []:
        m = CUDA_IPC.fullmatch(f.name)
        with contextlib.suppress(OSError):
            if m and f.stat().st_uid == os.getuid() and not alive(int(m[1]) if m[1] else int(m[2], 16)):
                f.unlink()
                removed.append(f)
    return removed


SEGMENT = re.compile(r"psm_[0-9a-f]{8,32}|sem\.mp-[a-z0-9_]{8,16}")  # shared memory, semaphores


# the ipc transport's: torch's reference counts of CUDA IPC storages (torch_PID_...), CUDA's IPC events
# (cuda.shm.DEVICE.HEXPID.N); a learner killed with SIGKILL leaves them
CUDA_IPC = re.compile(r"torch_(\d+)_\d+_\d+|cuda\.shm\.\d+\.([0-9a-f]+)\.\d+")


def shm_segments() -> set[str]:
    """Names in /dev/shm of Python's shared-memory segments and multiprocessing semaphores (vLLM's)."""
    if not SHM_ROOT.is_dir():
        return set()
    return {p.name for p in SHM_ROOT.iterdir() if SEGMENT.fullmatch(p.name)}


def own_segments(before: set[str]) -> list[str]:
    """The segments that appeared since `before` and that this process or its descendants map: a vLLM engine's,
    made while it started, not those of an engine starting beside it."""
    new = [n for n in shm_segments() - before if (SHM_ROOT / n).stat().st_uid == os.getuid()]
    return mapped_segments(new, process_tree(os.getpid()))


def record_segments(names: list[str]) -> list[str]:
    """Record `names` (own_segments) in this process's folder: if the process is killed with its engine (SIGKILL to
    the group: nobody unlinks them), remove_stale removes them with the folder."""
    if names:
        (private_dir(receiver_dir()) / "segments").write_text("\n".join(names))
    return names


def remove_left_segments(segments: list[str]) -> None:
    """Unlink the engine's shared-memory segments that outlived it: its processes do not unlink them on every way
    out. Not one that another live process maps."""
    others = set(processes()) - {os.getpid()}
    for name in set(segments) - set(mapped_segments(segments, others)):
        with contextlib.suppress(OSError):
            (SHM_ROOT / name).unlink()


def mapped_segments(names, pids: set[int]) -> list[str]:
    """Those of /dev/shm's `names` that a process of `pids` maps. Compared by inode: a semaphore is mapped under the
    temporary name it was made with."""
    inodes = {}
    for name in names:
        with contextlib.suppress(OSError):
            inodes[(SHM_ROOT / name).stat().st_ino] = name
    seen = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(str(SHM_ROOT)) and int(fields[4]) in inodes:
                    seen.add(inodes[int(fields[4])])
    return sorted(seen)


def process_tree(root: int) -> set[int]:
    """Process `root` and its descendants (a generator's: vLLM's engine core and workers)."""
    parent = {pid: ppid for pid, (_, ppid, _) in processes().items()}
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += [p for p, pp in parent.items() if pp == pid]
    return tree


def _remove_segments(d: Path) -> None:
    try:
        names = (d / "segments").read_text().split()
    except OSError:
        return
    for name in names:
        path = SHM_ROOT / name
        with contextlib.suppress(OSError):
            if SEGMENT.fullmatch(name) and path.stat().st_uid == os.getuid():
                path.unlink()


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (exited, its parent, often init once its own parent is gone, not done reaping it)
    holds no file open or mapped, and no more runs than a pid that is gone."""
    try:
        return _fields(Path(f"/proc/{pid}/stat"))[0] != "Z"
    except (OSError, IndexError):
        return False


def receiver_dir() -> Path:
    """The zmq receiver's folder of this process (one version's file at a time)."""
    return (SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())) / f"pipeline-recv-{os.getpid()}"


def remove_receiver_dir() -> None:
    remove_dir(receiver_dir())
