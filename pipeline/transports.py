"""Weight transports: how a new weights version gets from the learner into the generators.

The learner serialises the weights once per version into a safetensors blob, with a crc32 checksum,
and the hub announces `WeightsReady` on the PUB socket. What a generator does with the announcement
depends on the transport chosen for it at registration (`make_receiver`, picked once):
  zmq  pulls the blob from the hub in chunks over the control channel (any host, late joiners);
  shm  reads the file the learner wrote to /dev/shm (same host: no socket copy).
Announcements always travel over ZeroMQ; a new transport implements `Receiver.fetch`.
"""

from __future__ import annotations

import asyncio
import os
import socket
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


def write_shm(run_id: str, version: int, blob: bytes, keep: int = 2) -> str:
    """Write the blob for `version` atomically; remove all but the newest `keep` versions."""
    d = shm_dir(run_id)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"weights-v{version}.safetensors"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    for old in d.glob("weights-v*.safetensors"):
        if int(old.stem.split("-v")[1]) <= version - keep:
            old.unlink(missing_ok=True)
    return str(path)


def remove_shm(run_id: str) -> None:
    d = shm_dir(run_id)
    for f in d.glob("*"):
        f.unlink(missing_ok=True)
    if d.exists():
        d.rmdir()


class ChecksumMismatch(P.ProtocolError):
    pass


class Receiver:
    """Generator side of a transport: turn an announcement into bytes the engine can load."""

    name = ""

    async def fetch(self, ready: P.WeightsReady) -> bytes:
        raise NotImplementedError


class ZmqReceiver(Receiver):
    name = "zmq"

    def __init__(self, client, chunk_bytes: int, window: int = 4):
        self.client, self.chunk, self.window = client, chunk_bytes, window

    async def fetch(self, ready: P.WeightsReady) -> bytes:
        buf = bytearray(ready.size)
        offsets = list(range(0, ready.size, self.chunk))
        sem = asyncio.Semaphore(self.window)  # chunks in flight: keeps the socket busy without flooding it

        async def one(off: int) -> None:
            async with sem:
                reply = await self.client.request(P.WeightsFetch(ready.version, off, self.chunk))
            if not isinstance(reply, P.WeightsChunk):
                raise P.ProtocolError(f"weights v{ready.version} at {off}: {getattr(reply, 'message', reply)}")
            buf[off:off + len(reply.data)] = reply.data

        await asyncio.gather(*(one(o) for o in offsets))
        return _verified(bytes(buf), ready)


class ShmReceiver(Receiver):
    """Reads the learner's /dev/shm file; falls back to zmq for a version that was not written there
    (published before this generator registered, or already removed as old)."""

    name = "shm"

    def __init__(self, fallback: Receiver):
        self.fallback = fallback

    async def fetch(self, ready: P.WeightsReady) -> bytes:
        try:
            if not ready.shm_path:
                raise FileNotFoundError
            blob = await asyncio.to_thread(Path(ready.shm_path).read_bytes)
        except FileNotFoundError:
            return await self.fallback.fetch(ready)
        return _verified(blob, ready)


def _verified(blob: bytes, ready: P.WeightsReady) -> bytes:
    got = checksum(blob)
    if len(blob) != ready.size or got != ready.checksum:
        raise ChecksumMismatch(
            f"weights v{ready.version}: {len(blob)} bytes with crc32 {got:#x}, announced {ready.size} bytes "
            f"with crc32 {ready.checksum:#x}"
        )
    return blob


def make_receiver(transport: str, client, chunk_mb: int) -> Receiver:
    if transport == "zmq":
        return ZmqReceiver(client, chunk_mb * 2**20)
    if transport == "shm":
        return ShmReceiver(ZmqReceiver(client, chunk_mb * 2**20))
    raise ValueError(f"weights.transport: {transport!r} is not available here (zmq, shm)")
