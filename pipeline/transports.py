"""Weight transports: how a new weights version gets from the learner into the generators.

The learner serialises the weights once per version into a safetensors blob, with a crc32 checksum,
and the hub announces `WeightsReady` on the PUB socket. What a generator does with the announcement
depends on the transport chosen for it at registration (`make_receiver`, picked once):
  zmq  pulls the blob from the hub in chunks over the control channel into a local file (any host,
       late joiners);
  shm  uses the file the learner wrote to /dev/shm (same host: no socket copy).
Either way the engine's workers get a path and read the file once.
  nccl the learner broadcasts each version into the generator's workers, the first one too (learner/collective.py).
Announcements always travel over ZeroMQ; a new transport implements `Receiver.fetch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from pipeline import protocol as P

SHM_ROOT = Path("/dev/shm")


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): two processes with the same boot id share /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def serialize(named_tensors: Iterable) -> bytes:
    """(name, tensor) pairs -> one safetensors blob (tensors are moved to CPU one at a time)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in named_tensors})


def checksum(blob) -> int:
    return zlib.crc32(blob)


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
    d = shm_dir(run_id)
    if not (d / "owner").exists():
        private_dir(d)
    path = d / f"weights-v{version}.safetensors"
    write_private(path, blob)
    for old in d.glob("weights-v*.safetensors"):
        if int(old.stem.split("-v")[1]) <= version - keep:
            old.unlink(missing_ok=True)
    return str(path)


def remove_dir(d: Path) -> None:
    for f in d.glob("*"):
        f.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        d.rmdir()


def remove_shm(run_id: str) -> None:
    remove_dir(shm_dir(run_id))


def remove_stale() -> list[Path]:
    """Remove this user's pipeline folders in /dev/shm (and the temp folder) whose owner process is gone: a
    learner or generator killed with SIGKILL cannot clean up after itself. Returns what was removed."""
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
                remove_dir(d)
                removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ChecksumMismatch(P.ProtocolError):
    pass


class Receiver:
    """Generator side of a transport: turn an announcement into a verified safetensors file.

    The file's path (not its bytes) goes to the engine's workers, which read it once; the checksum is
    checked here, before the engine pauses for the update.
    """

    name = ""
    collective = False  # True: versions arrive as broadcasts into the workers, not as files

    @property
    def via(self) -> str:
        """The transport that delivered the last version fetched (shm may have fallen back to zmq)."""
        return self.name

    async def fetch(self, ready: P.WeightsReady) -> str:
        raise NotImplementedError


class ZmqReceiver(Receiver):
    """Pulls the blob from the hub in chunks (several in flight) straight into a local file."""

    name = "zmq"

    def __init__(self, client, chunk_bytes: int, generator_id: str = "", window: int = 4):
        self.client, self.chunk, self.window, self.generator_id = client, chunk_bytes, window, generator_id
        self.dir = receiver_dir()

    async def fetch(self, ready: P.WeightsReady) -> str:
        if not (self.dir / "owner").exists():
            private_dir(self.dir)
        for old in self.dir.glob("weights-v*.safetensors"):
            old.unlink(missing_ok=True)  # the engine has loaded the previous version already
        path = self.dir / f"weights-v{ready.version}.safetensors"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, ready.size)
            sem = asyncio.Semaphore(self.window)  # chunks in flight: keeps the socket busy without flooding it

            async def one(off: int) -> None:
                async with sem:
                    reply = await self.client.request(P.WeightsFetch(ready.version, off, self.chunk, self.generator_id))
                if not isinstance(reply, P.WeightsChunk):
                    raise P.ProtocolError(f"weights v{ready.version} at {off}: {getattr(reply, 'message', reply)}")
                os.pwrite(fd, reply.data, off)

            await asyncio.gather(*(one(o) for o in range(0, ready.size, self.chunk)))
        finally:
            os.close(fd)
        return await verify_file(str(path), ready)



def receiver_dir() -> Path:
    """The zmq receiver's folder of this process (one version's file at a time)."""
    return (SHM_ROOT if SHM_ROOT.is_dir() else Path(tempfile.gettempdir())) / f"pipeline-recv-{os.getpid()}"


def remove_receiver_dir() -> None:
    remove_dir(receiver_dir())


class ShmReceiver(Receiver):
    """Uses the file the learner wrote to /dev/shm; falls back to zmq for a version that was not written
    there (published before this generator registered, or already removed as old)."""

    name = "shm"

    def __init__(self, fallback: Receiver):
        self.fallback = fallback
        self._via = self.name

    async def fetch(self, ready: P.WeightsReady) -> str:
        if not ready.shm_path or not Path(ready.shm_path).exists():
            self._via = self.fallback.name
            return await self.fallback.fetch(ready)
        self._via = self.name
        return await verify_file(ready.shm_path, ready)

    @property
    def via(self) -> str:
        return self._via


async def verify_file(path: str, ready: P.WeightsReady) -> str:
    """Check size and crc32 of the file against the announcement (in a thread: crc32 releases the GIL)."""

    def crc() -> tuple[int, int]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 0, 0
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return size, zlib.crc32(m)

    size, got = await asyncio.to_thread(crc)
    if size != ready.size or got != ready.checksum:
        raise ChecksumMismatch(
            f"weights v{ready.version}: {path} has {size} bytes with crc32 {got:#x}, announced {ready.size} bytes "
            f"with crc32 {ready.checksum:#x}"
        )
    return path


class CollectiveReceiver(Receiver):
    """nccl: every version, the one current at registration too, arrives as broadcasts into the engine's
    workers (`collective = True` announcements); there is no file to fetch."""

    name = "nccl"
    collective = True


def make_receiver(transport: str, client, chunk_mb: int, generator_id: str = "") -> Receiver:
    zmq_receiver = ZmqReceiver(client, chunk_mb * 2**20, generator_id)
    if transport == "zmq":
        return zmq_receiver
    if transport == "shm":
        return ShmReceiver(zmq_receiver)
    if transport == "nccl":
        return CollectiveReceiver()
    raise ValueError(f"weights.transport: {transport!r} is not available here (zmq, shm, nccl)")
