"""The zmq transport: a generator pulls each version's blob from the hub in chunks over its control channel.

Works across hosts and for late joiners. The learner's side is the hub's `Blobs` (the newest blobs by version,
served chunk by chunk to registered generators, a few chunks in flight per peer; a version being pulled is kept
until the pull ends); the generator's side is `ZmqReceiver`, which writes the chunks straight into a private file,
verifies it and hands the engine its path. A version no longer served raises `weights.VersionGone`: the generator
takes the newest announced instead, without registering again.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import protocol as P
from pipeline.host import private_dir, receiver_dir
from weights import VersionGone
from weights.base import Engine, Receiver
from weights.files import ChecksumMismatch, verify_file

if TYPE_CHECKING:
    from pipeline.client import HubClient

KEEP = 2  # the newest versions always served
PULLED_MAX = 2  # older versions kept while a generator pulls them: each is a blob of the model's size in host memory
GONE = "is no longer served"  # said in the error (Error.gone) a pull of a dropped version gets


class Blobs:
    """The learner's side: the safetensors blobs (and deltas) of the newest two versions, and of an older version
    while a generator pulls it. A pull slower than two learner steps would otherwise lose its version halfway
    and never apply one. At most PULLED_MAX older versions are kept; past that the oldest goes, and a generator
    pulling it is told it cannot keep up."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.by_version: dict[int, bytes | bytearray | mmap.mmap] = {}
        self.deltas: dict[int, bytes] = {}  # weights.delta: version -> the delta from the version before
        self.pulling: dict[str, int] = {}  # generator id -> the version it pulls (from its first chunk to `done`)
        self.newest = -1

    def put(self, version: int, blob: bytes | bytearray | mmap.mmap, delta: bytes | None = None) -> None:
        self.by_version[version] = blob
        if delta is not None:
            self.deltas[version] = delta
        self.newest = max(self.newest, version)
        self._trim()

    def done(self, generator_id: str) -> None:
        """Its pull ended (it applied a version, registers again, or left): its version is no longer kept for it."""
        if self.pulling.pop(generator_id, None) is not None:
            self._trim()

    def _trim(self) -> None:
        keep = {v for v in self.by_version if v > self.newest - KEEP}
        pulled = sorted({v for v in self.pulling.values() if v in self.by_version} - keep, reverse=True)
        keep.update(pulled[:PULLED_MAX])
        for kept in (self.by_version, self.deltas):
            for v in [v for v in kept if v not in keep]:
                del kept[v]

    def chunk(self, msg: P.WeightsFetch, generator_id: str, latest: int) -> P.Message:
        blob = (self.deltas if msg.delta else self.by_version).get(msg.version)
        if blob is None:
            cut = self.pulling.get(generator_id) == msg.version  # dropped while this generator pulled it
            if cut:
                del self.pulling[generator_id]
            return P.Error(f"weights version {msg.version}{' (delta)' if msg.delta else ''} {GONE} (latest: {latest})"
                           + (f"; it was dropped while this generator pulled it: the generator cannot keep up (it "
                              f"pulls slower than the learner publishes, and {PULLED_MAX} older versions are kept "
                              "for slower pulls already)" if cut else ""), gone=True)
        if self.pulling.get(generator_id) != msg.version:
            self.pulling[generator_id] = msg.version
            self._trim()  # the version it pulled before, if any, is no longer kept for it
        end = min(len(blob), msg.offset + min(msg.length, self.chunk_bytes))
        data = memoryview(blob)[max(0, msg.offset):end]  # a view, not a copy: msgpack packs any buffer
        return P.WeightsChunk(msg.version, msg.offset, data, len(blob))  # type: ignore[arg-type]


class ZmqReceiver(Receiver):
    """The generator's side: several chunks in flight, each written where it belongs in a local file."""

    name = "zmq"
    in_order = False  # a file may skip to the newest announced version
    client: HubClient  # the chunks come over the generator's control connection

    def __init__(self, client: HubClient, chunk_bytes: int, generator_id: str = "", window: int = 4) -> None:
        super().__init__(client, chunk_bytes, generator_id)
        self.window = window
        self.dir = receiver_dir()
        self.via = self.name
        self.fetched = 0  # bytes pulled, blobs and deltas

    def accepts(self, ready: P.WeightsReady) -> bool:
        return ready.file is not None

    async def apply(self, ready: P.WeightsReady, engine: Engine) -> float:
        """Fetch and verify the version, then load it; returns milliseconds the engine stopped generating."""
        path = await self.fetch(ready)
        return await engine.swap(ready.version, "load_weights_blob", path, None)

    async def fetch(self, ready: P.WeightsReady) -> str:
        file = ready.file
        assert file is not None  # accepts() took it
        if not (self.dir / "owner").exists():
            private_dir(self.dir)
        target = self.dir / f"weights-v{ready.version}.safetensors"
        base = self.dir / f"weights-v{file.delta_base}.safetensors"
        if file.delta_base < 0 or not base.exists():
            self._remove_all_but(None)  # no delta to apply: the old files are not needed while the blob comes
        try:
            if file.delta_base < 0 or not base.exists():
                raise FileNotFoundError
            self.via = f"{self.name}-delta"
            await self._fetch_delta(ready, base, target)
            path = await verify_file(str(target), ready)
        except (FileNotFoundError, ChecksumMismatch, ValueError, P.ProtocolError):  # the full blob will do
            self.via = self.name
            try:
                await self._pull(ready, target, False, file.size,
                                 os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
            except VersionGone:
                target.unlink(missing_ok=True)  # a part of a blob: never the base of a delta
                raise
            path = await verify_file(str(target), ready)
        self._remove_all_but(path)  # the engine has loaded the previous version; this one is the next base
        return path

    def _remove_all_but(self, keep: str | None) -> None:
        for old in self.dir.glob("weights-v*.safetensors"):
            if keep is None or old.name != str(keep).rsplit("/", 1)[-1]:
                old.unlink(missing_ok=True)

    async def _fetch_delta(self, ready: P.WeightsReady, base: Path, path: Path) -> None:
        from weights.delta import apply
        from weights.plan import checksum

        file = ready.file
        assert file is not None  # accepts() took it
        buf = bytearray(file.delta_size)
        await self._pull(ready, path, True, len(buf), buf)
        if checksum(buf) != file.delta_checksum:
            raise ChecksumMismatch(f"weights v{ready.version}: delta crc32 mismatch")
        blob = await asyncio.to_thread(lambda: apply(base.read_bytes(), buf))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob.data)
        self.fetched += len(buf)

    async def _pull(self, ready: P.WeightsReady, path: Path, delta: bool, size: int, into: int | bytearray) -> None:
        """`size` bytes of the version's blob (or delta) in chunks, several in flight, into a file descriptor
        (closed here) or a bytearray."""
        try:
            if isinstance(into, int):
                os.ftruncate(into, size)
            sem = asyncio.Semaphore(self.window)  # chunks in flight: keeps the socket busy without flooding it

            async def one(off: int) -> None:
                async with sem:
                    reply = await self.client.request(P.WeightsFetch(ready.version, off, self.chunk, self.generator_id,
                                                                     delta))
                if isinstance(reply, P.Error) and reply.gone:  # the receiver moves to the newest announced
                    raise VersionGone(reply.message)
                if not isinstance(reply, P.WeightsChunk):
                    raise P.ProtocolError(f"weights v{ready.version} at {off}: {getattr(reply, 'message', reply)}")
                if isinstance(into, int):
                    os.pwrite(into, reply.data, off)
                else:
                    into[off:off + len(reply.data)] = reply.data

            tasks = [asyncio.ensure_future(one(o)) for o in range(0, size, self.chunk)]
            try:
                await asyncio.gather(*tasks)
            finally:  # one failed: the others stop before the file is closed (its descriptor may be reused)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if not delta:
                self.fetched += size
        finally:
            if isinstance(into, int):
                os.close(into)
