"""Weights as files: the shm transport's blobs in /dev/shm, written atomically, checked, and the learner's sender
of both file transports.

The learner writes a version's safetensors blob to /dev/shm for the shm transport (`write_shm`, in a private
folder of pipeline/host.py, which also sweeps what a killed process left); a zmq receiver pulls it into a folder
of its own (host.receiver_dir). `verify_file` checks size and crc32 against the announcement before an engine
pauses for the update.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import host
from pipeline import protocol as P
from pipeline.host import private_dir, remove_dir, write_private
from weights import delta
from weights.base import Announcer, Sender, Worker

if TYPE_CHECKING:
    import torch

    from pipeline.config import Config


def shm_dir(run_id: str) -> Path:
    return host.SHM_ROOT / f"pipeline-{run_id}"


def write_shm(run_id: str, version: int, blob: bytes, keep: int = 2) -> str:
    """Write the blob for `version` atomically; remove all but the newest `keep` versions."""
    path = _shm_path(run_id, version)
    write_private(path, blob)
    _remove_old(path.parent, version, keep)
    return str(path)


def serialize_to_shm(run_id: str, version: int, named: list[tuple[str, torch.Tensor]],
                     keep: int = 2) -> tuple[str, mmap.mmap]:
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
        assert isinstance(blob, mmap.mmap)  # what `mapped` made
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


def remove_shm(run_id: str) -> None:
    remove_dir(shm_dir(run_id))


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
    assert want is not None  # an announcement of a file transport (the receivers' accepts)
    if size != want.size or got != want.checksum:
        raise ChecksumMismatch(
            f"weights v{ready.version}: {path} has {size} bytes with crc32 {got:#x}, announced {want.size} bytes "
            f"with crc32 {want.checksum:#x}"
        )
    return path


class FileSender(Sender):
    """The learner's side of the file transports (zmq and shm share it: one blob serves both). Each version's
    CPU copy is serialised into a safetensors blob in a background thread, written to /dev/shm while a
    generator uses shm, kept by the hub for zmq pulls, and announced. Only while some generator uses a file
    transport (or none is registered: the next one may). With `weights.delta`, the bytes that changed since the
    version before are served too (weights/delta.py)."""

    device = None  # packs wherever the learner does

    def __init__(self, cfg: Config, announcer: Announcer, run_id: str) -> None:
        super().__init__(cfg, announcer, run_id)
        self.transport, self.delta = cfg.weights.transport, cfg.weights.delta
        self.transports = {self.transport}  # set by weights.senders: the ones it serves
        self.serialize_ms = 0.0  # of the last announced blob
        self.sizes = (0, 0)  # of the last version: bytes of the blob, of its delta (0: none)
        self._last: tuple[int, bytes | bytearray | mmap.mmap] | None = None  # (version, blob): the next delta's base

    def join(self, register: P.Register, ident: bytes, version: int) -> None:
        """The newest file version right after the Welcome, on the one route versions take; if the newest
        version has no blob (none yet, or it went by broadcast only), one is made in the background."""
        last = self.announcer.last_file_version()
        if last is not None:
            self.announcer.push(ident, last)
        if self.latest is not None and (last is None or last.version < version):
            self.latest(self._send_newest, background=True)

    def wanted(self) -> bool:
        return self.announcer.wants_blobs(self.transports)

    def send(self, version: int, named: list[tuple[str, torch.Tensor]], published_at: float) -> None:
        from weights.plan import checksum, serialize

        start = time.perf_counter()
        blob: bytearray | mmap.mmap
        if self.transport == "shm" or self.announcer.uses_transport("shm"):
            shm_path, blob = serialize_to_shm(self.run_id, version, named)
        else:
            shm_path, blob = "", serialize(named)
        file, diff = P.FileVersion(len(blob), checksum(blob), shm_path), None
        if self.delta and self._last is not None and self._last[0] == version - 1:
            diff = delta.encode(self._last[1], blob)
            if diff is not None:
                file.delta_base, file.delta_size, file.delta_checksum = version - 1, len(diff), checksum(diff)
        self._last = (version, blob) if self.delta else None
        self.announcer.announce(P.WeightsReady(version, published_at, file), blob, delta=diff,
                                transports=self.transports)
        self.sizes = (len(blob), len(diff) if diff is not None else 0)
        self.serialize_ms = (time.perf_counter() - start) * 1000

    def _send_newest(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        last = self.announcer.last_file_version()
        if last is None or last.version < version:
            self.send(version, named, 0.0)

    def metrics(self) -> dict:
        return {"sync/serialize_ms": self.serialize_ms, "sync/blob_bytes": self.sizes[0],
                "sync/delta_bytes": self.sizes[1]}


class BlobWorker(Worker):
    """In each vLLM worker: a version's safetensors blob, or the file holding it, loaded (both file transports).
    A path, not tensors, crosses collective_rpc: tensors given as its arguments would arrive as lists in
    multi-process mode. The checksum is verified here, where the bytes are finally read, unless the receiver
    verified the file already (outside the engine's pause)."""

    def load_weights_blob(self, source: bytes | str, crc32: int | None = None) -> list:
        """Load a safetensors blob (bytes) or file (path; memory-mapped, read straight to this worker's
        device). `crc32=None`: the caller has verified the file already, outside the engine's pause."""
        from safetensors.torch import load, load_file

        from weights.plan import checksum

        start = time.perf_counter()
        if isinstance(source, str):
            if crc32 is not None:
                with open(source, "rb") as f:
                    _check(checksum(f.read()), crc32)
            tensors = load_file(source, device=str(getattr(self, "device", "cpu")))
        else:
            if crc32 is not None:
                _check(checksum(source), crc32)
            tensors = load(source)
        self._in_step_gap(lambda: self._load_named(list(tensors.items())))
        return [(time.perf_counter() - start) * 1000, ""]


def _check(got: int, announced: int) -> None:
    if got != announced:
        raise ValueError(f"weights checksum mismatch: got crc32 {got:#x}, announced {announced:#x}")
