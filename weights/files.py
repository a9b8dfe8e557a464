"""Weights on the local file system: private folders in /dev/shm, atomic writes, checks, and clean-up.

The learner writes a version's safetensors blob to /dev/shm for the shm transport (`write_shm`); a zmq
receiver pulls it into a folder of its own (`receiver_dir`). Folders are 0700 and files 0600 (weights are
not everyone's), each folder names its owner process, so what a process killed with SIGKILL left behind is
removed by the next learner or launcher (`remove_stale`), with the shared-memory segments its vLLM engine made
(`record_segments`). `verify_file` checks size and crc32 against the
announcement before an engine pauses for the update.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import socket
import tempfile
import time
from pathlib import Path

from pipeline import protocol as P
from pipeline.launcher import processes
from weights import delta

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


def shm_dir(run_id: str) -> Path:
    return SHM_ROOT / f"pipeline-{run_id}"


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


def write_shm(run_id: str, version: int, blob: bytes, keep: int = 2) -> str:
    """Write the blob for `version` atomically; remove all but the newest `keep` versions."""
    path = _shm_path(run_id, version)
    write_private(path, blob)
    _remove_old(path.parent, version, keep)
    return str(path)


def serialize_to_shm(run_id: str, version: int, named, keep: int = 2) -> tuple[str, mmap.mmap]:
    """`weights.plan.serialize` straight into the shm file of `version` (atomically, as write_shm): one copy of
    each tensor, not a blob then a write. Returns the path and the file's memory map, which serves as the blob
    (zmq pulls, deltas) and outlives the file's removal."""
    from weights.plan import serialize

    path = _shm_path(run_id, version)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        def mapped(size: int) -> mmap.mmap:
            os.ftruncate(fd, size)
            return mmap.mmap(fd, size)

        blob = serialize(named, mapped)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _remove_old(path.parent, version, keep)
    return str(path), blob


def _shm_path(run_id: str, version: int) -> Path:
    d = shm_dir(run_id)
    if not (d / "owner").exists():
        private_dir(d)
    return d / f"weights-v{version}.safetensors"


def _remove_old(d: Path, version: int, keep: int) -> None:
    for old in d.glob("weights-v*.safetensors"):
        if int(old.stem.split("-v")[1]) <= version - keep:
            old.unlink(missing_ok=True)


def remove_dir(d: Path) -> None:
    for f in d.glob("*"):
        f.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        d.rmdir()


def remove_shm(run_id: str) -> None:
    remove_dir(shm_dir(run_id))


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
            if not _alive(pid):
                _remove_segments(d)
                remove_dir(d)
                removed.append(d)
    for f in SHM_ROOT.iterdir() if SHM_ROOT.is_dir() else []:
        m = CUDA_IPC.fullmatch(f.name)
        with contextlib.suppress(OSError):
            if m and f.stat().st_uid == os.getuid() and not _alive(int(m[1]) if m[1] else int(m[2], 16)):
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def receiver_dir() -> Path:
    """The zmq receiver's folder of this process (one version's file at a time)."""
    return (SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())) / f"pipeline-recv-{os.getpid()}"


def remove_receiver_dir() -> None:
    remove_dir(receiver_dir())


class ChecksumMismatch(P.ProtocolError):
    pass


async def verify_file(path: str, ready: P.WeightsReady) -> str:
    """Check size and crc32 of the file against the announcement (in a thread: crc32 releases the GIL)."""

    from weights.plan import checksum

    def crc() -> tuple[int, int]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 0, 0
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return size, checksum(m)

    size, got = await asyncio.to_thread(crc)
    want = ready.file
    if size != want.size or got != want.checksum:
        raise ChecksumMismatch(
            f"weights v{ready.version}: {path} has {size} bytes with crc32 {got:#x}, announced {want.size} bytes "
            f"with crc32 {want.checksum:#x}"
        )
    return path


class FileSender:
    """The learner's side of the file transports (zmq and shm share it: one blob serves both). Each version's
    CPU copy is serialised into a safetensors blob in a background thread, written to /dev/shm while a
    generator uses shm, kept by the hub for zmq pulls, and announced. Only while some generator uses a file
    transport (or none is registered: the next one may). With `weights.delta`, the bytes that changed since the
    version before are served too (weights/delta.py)."""

    device = None  # packs wherever the learner does

    def __init__(self, cfg, hub, run_id: str):
        self.hub, self.run_id, self.transport, self.delta = hub, run_id, cfg.weights.transport, cfg.weights.delta
        self.latest = None  # set by the publisher
        self.transports = {self.transport}  # set by weights.senders: the ones it serves
        self.serialize_ms = 0.0  # of the last announced blob
        self.sizes = (0, 0)  # of the last version: bytes of the blob, of its delta (0: none)
        self._last: tuple[int, bytes] | None = None  # (version, blob): the base of the next delta

    @staticmethod
    def available() -> bool:
        return True

    def join(self, register: P.Register, ident: bytes, version: int) -> None:
        """The newest file version right after the Welcome, on the one route versions take; if the newest
        version has no blob (none yet, or it went by broadcast only), one is made in the background."""
        last = self.hub.weights.last_ready
        if last is not None:
            self.hub.server.push(ident, P.encode(last))
        if self.latest is not None and (last is None or last.version < version):
            self.latest(self._send_newest, background=True)

    def leave(self, generator_id: str, again: bool = False) -> None:
        pass

    def begin(self, version: int, plan, published_at: float) -> bool:
        return False

    def bucket(self, flat) -> None:
        pass

    def end(self) -> None:
        pass

    def wanted(self) -> bool:
        return self.hub.wants_blobs(self.transports)

    def send(self, version: int, named, published_at: float) -> None:
        from weights.plan import checksum, serialize

        start = time.perf_counter()
        if self.transport == "shm" or self.hub.uses_transport("shm"):
            shm_path, blob = serialize_to_shm(self.run_id, version, named)
        else:
            shm_path, blob = "", serialize(named)
        file, diff = P.FileVersion(len(blob), checksum(blob), shm_path), None
        if self.delta and self._last is not None and self._last[0] == version - 1:
            diff = delta.encode(self._last[1], blob)
            if diff is not None:
                file.delta_base, file.delta_size, file.delta_checksum = version - 1, len(diff), checksum(diff)
        self._last = (version, blob) if self.delta else None
        self.hub.announce(P.WeightsReady(version, published_at, file), blob, delta=diff, transports=self.transports)
        self.sizes = (len(blob), len(diff) if diff is not None else 0)
        self.serialize_ms = (time.perf_counter() - start) * 1000

    def on_applied(self, generator_id: str, version: int) -> None:
        pass

    def shutdown(self) -> None:
        pass  # the learner removes the run's shm folder (remove_shm)

    def _send_newest(self, version: int, named) -> None:
        last = self.hub.weights.last_ready
        if last is None or last.version < version:
            self.send(version, named, 0.0)

    def metrics(self) -> dict:
        return {"sync/serialize_ms": self.serialize_ms, "sync/blob_bytes": self.sizes[0],
                "sync/delta_bytes": self.sizes[1]}
