"""The ipc transport: a generator on the learner's own GPU copies each version straight out of the learner's memory.

For the colocated setup (one GPU for learner and generator). The learner keeps one set of flat buckets of
the model's size on its GPU, shared over CUDA IPC. Each version is packed as for nccl; each bucket is copied
into its shared buffer, and once the last one is in, `WeightsReady` carries the buffers' handles (`ipc`) to
the generators of this transport. Their vLLM workers open the handles once and copy the buffers into the
weights between two engine steps, replaying the copies load_weights made the first time (generator.copyplan),
as the nccl staged receive does. No file, no checksum, no CPU copy on the way.

One set of buffers: the learner writes version v only once every generator of this transport has applied
the version before (`WeightsApplied`). At k = 0 that has always happened; otherwise the generator swaps at its
next engine step. A generator that has not applied it within `weights.collective_timeout_s` is dropped (by
the hub too: its prompts are leased again, and its next request tells it to register again, when `auto`
gives it another transport). A worker that finds the handles are not of its
own GPU (compared by UUID) fails the load, and `auto` gives it shm when it registers again.

The handles are CUDA's: any process of this user on the host that can open them reads the weights, as with
the shm transport's files. Sharing them makes CUDA create small files in /dev/shm (`cuda.shm.*`, its IPC
events), which outlive the learner's process; the sender notes the ones made while it exported its buffers
and removes them at the end of the run (`shutdown`). A learner killed with SIGKILL leaves them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline import protocol as P
from weights.base import Announcer, Engine, Receiver, Sender, Worker
from weights.plan import Packer, buckets, manifest

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger(__name__)
SHM = Path("/dev/shm")


def _cuda_files() -> set[str]:
    return {p.name for p in SHM.glob("cuda.shm.*")} if SHM.is_dir() else set()


def export(t: torch.Tensor) -> P.IpcBuffer:
    """The IPC handle of a contiguous uint8 CUDA tensor that owns its storage."""
    _, handle, size, offset, ref_handle, ref_offset, event, event_sync = t.untyped_storage()._share_cuda_()
    return P.IpcBuffer(handle, size, offset, ref_handle, ref_offset, event, event_sync)


def check_handles(ipc: P.IpcHandles, manifest: list) -> None:
    """ProtocolError unless `ipc` holds one buffer, large enough, for each bucket of `manifest`."""
    plan = buckets(manifest)
    if len(ipc.buffers) != len(plan):
        raise P.ProtocolError(f"WeightsReady.ipc: {len(ipc.buffers)} buffers for {len(plan)} buckets")
    for i, (b, (_, _, size)) in enumerate(zip(ipc.buffers, plan, strict=True)):
        if b.size < size or b.offset < 0 or b.ref_offset < 0:
            raise P.ProtocolError(f"WeightsReady.ipc.buffers[{i}]: {b.size} bytes at offset {b.offset} for a bucket "
                                  f"of {size}")


def open_buffers(ipc: P.IpcHandles, manifest: list, device: torch.device | str) -> list[torch.Tensor]:
    """The learner's buffers, opened in this process on `device` (which must be the learner's GPU); `ipc` passed
    `check_handles` in the generator."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    mine = str(torch.cuda.get_device_properties(index).uuid)
    if mine != ipc.uuid:
        raise RuntimeError(f"ipc transport: the learner's buffers are on GPU {ipc.uuid}, this worker runs on {mine}; "
                           "the ipc transport needs the learner's own GPU")
    out = []
    for b, (_, _, n) in zip(ipc.buffers, buckets(manifest), strict=True):
        t = rebuild_cuda_tensor(torch.Tensor, (b.size,), (1,), 0, torch.UntypedStorage, torch.uint8, index, b.handle,
                                b.size, b.offset, False, b.ref_handle, b.ref_offset, b.event, b.event_sync)
        out.append(t[:n])
    return out


class IpcSender(Sender):
    """The learner's side: one set of shared buckets on its GPU, written when every generator of this transport
    has applied the version before, then announced with their handles."""

    def __init__(self, cfg: Config, announcer: Announcer, run_id: str) -> None:
        if not torch.cuda.is_available():
            raise ValueError("weights.transport ipc: the learner has no CUDA device to share its buffers from "
                             "(use auto, shm or zmq)")
        super().__init__(cfg, announcer, run_id)
        self.device: torch.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = cfg.weights.collective_timeout_s
        self.changed = threading.Condition()
        self.applied: dict[str, int] = {}  # generator id: the version it applied last (-1: none yet)
        self.failed: set[str] = set()  # dropped, or its workers could not open the buffers: `auto` gives it shm
        # the publisher (from `begin` to `end`) vs. a joiner's first version; taken before the
        # publisher's own lock on both paths
        self.write_lock = threading.Lock()
        self.buffers: list[torch.Tensor] = []
        self.ipc: P.IpcHandles | None = None  # the buffers' handles, as WeightsReady carries them
        self.plan: list = []  # the manifest the buffers are laid out for
        self.written = -1  # the version in the buffers
        self.files: set[str] = set()  # CUDA's files in /dev/shm made while exporting the buffers
        self.wait_ms = 0.0  # of the last version: waiting for generators to apply the one before
        self._version, self._published_at, self._next = -1, 0.0, 0
        self._to: list[str] = []

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    def join(self, register: P.Register, ident: bytes, version: int) -> None:
        """A generator on the learner's GPU registers: it gets the newest version after its Welcome."""
        with self.changed:
            self.applied[register.generator_id] = -1
        threading.Thread(target=self._catch_up, args=(register.generator_id,), daemon=True,
                         name=f"ipc-join-{register.generator_id}").start()

    def leave(self, generator_id: str, again: bool = False) -> None:
        with self.changed:
            never_applied = self.applied.pop(generator_id, None) == -1
            self.changed.notify_all()
        if again and never_applied:  # e.g. its workers are on another GPU: `auto` gives it shm next time
            self.failed.add(generator_id)

    def on_applied(self, generator_id: str, version: int) -> None:
        with self.changed:
            if generator_id in self.applied:
                self.applied[generator_id] = max(self.applied[generator_id], version)
                self.changed.notify_all()

    def begin(self, version: int, plan: list, published_at: float) -> bool:
        """Wait until the buffers are free (every generator applied what they hold), then take the buckets."""
        with self.changed:
            to = list(self.applied)
        if not to:
            return False
        self.write_lock.acquire()  # released by end() (or at once, below)
        try:
            to = self._wait_applied()
            if not to:
                self.write_lock.release()
                return False
            self._layout(plan)
        except BaseException:
            self.write_lock.release()
            raise
        self._version, self._published_at, self._to, self._next = version, published_at, to, 0
        return True

    def bucket(self, flat: torch.Tensor) -> None:
        self.bucket_in(flat)
        if self._next == len(self.buffers):
            self._announce(self._version, self._published_at, self._to)

    def end(self) -> None:
        self.write_lock.release()

    def metrics(self) -> dict:
        return {"sync/ipc_wait_ms": self.wait_ms}

    def _catch_up(self, generator_id: str) -> None:
        """A joiner's first version (a thread of its own): the newest, written from the learner's CPU copy if the
        buffers hold an older one (no generator of this transport was there when it was published)."""
        if self.latest is None:
            return
        with self.write_lock:
            self.latest(lambda version, named: self._send_newest(generator_id, version, named))

    def _send_newest(self, generator_id: str, version: int, named: list) -> None:
        with self.changed:
            if generator_id not in self.applied:
                return
        if self.written == version:
            self._announce(version, 0.0, [generator_id])
            return
        to = self._wait_applied()
        if generator_id not in to:
            return
        plan = manifest(named)
        self._layout(plan)
        self._next = 0
        Packer(plan, self.device, lambda flat, idx, offs: self.bucket_in(flat)).pack(t for _, t in named)
        self._announce(version, 0.0, to)

    def bucket_in(self, flat: torch.Tensor) -> None:
        self.buffers[self._next][: flat.numel()].copy_(flat)
        self._next += 1

    def _wait_applied(self) -> list[str]:
        """Wait until every generator of this transport applied the buffers' version; drop those that do not within
        the timeout. Returns the generators left."""
        start = time.perf_counter()
        with self.changed:
            done = self.changed.wait_for(lambda: all(v >= self.written for v in self.applied.values()),
                                         self.timeout_s)
            late = [] if done else [g for g, v in self.applied.items() if v < self.written]
            for g in late:
                del self.applied[g]
                self.failed.add(g)
            to = list(self.applied)
        for g in late:
            why = f"ipc transport: did not apply weights v{self.written} within {self.timeout_s:.0f} s"
            log.warning("%s %s; dropped (it registers again, with another transport)", g, why)
            self.announcer.drop(g, why)
        self.wait_ms = (time.perf_counter() - start) * 1000
        return to

    def _layout(self, plan: list) -> None:
        """Buffers for `plan`'s buckets (kept while the layout stays), and their handles."""
        if plan == self.plan:
            return
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for *_, size in buckets(plan)]
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        before = _cuda_files()
        self.ipc = P.IpcHandles(uuid, [export(b) for b in self.buffers])
        self.files |= _cuda_files() - before
        self.plan = plan

    def shutdown(self) -> None:
        """The run ends: remove CUDA's files of the exports (generators that still map them keep their mapping)."""
        for name in self.files:
            try:
                os.unlink(SHM / name)
            except FileNotFoundError:
                pass
        self.files.clear()

    def _announce(self, version: int, published_at: float, to: list[str]) -> None:
        torch.cuda.current_stream(self.device).synchronize()  # the copies are in before any generator reads
        self.written = version
        self.announcer.announce(P.WeightsReady(version, published_at, manifest=self.plan, ipc=self.ipc), None, to=to)


class IpcReceiver(Receiver):
    """The generator's side: every version is copied out of the learner's buffers by the engine's workers, in
    order (the learner waits for each to be applied before writing the next)."""

    name = via = "ipc"
    in_order = True

    def accepts(self, ready: P.WeightsReady) -> bool:
        return ready.ipc is not None

    async def apply(self, ready: P.WeightsReady, engine: Engine) -> float:
        assert ready.ipc is not None  # accepts() took it
        check_handles(ready.ipc, ready.manifest)
        return await engine.swap(ready.version, "apply_ipc", ready.manifest, asdict(ready.ipc))


class IpcWorker(Worker):
    """In each vLLM worker: a version copied out of the learner's shared buffers."""

    _ipc: tuple[P.IpcHandles, list[torch.Tensor]]  # the learner's handles and their buffers, once opened

    def apply_ipc(self, manifest: list, ipc: dict) -> list:
        """Copy a version out of the learner's buffers, shared over CUDA IPC (weights/ipc.py), into the weights
        between two engine steps; the buffers are opened once (again when the learner's handles change)."""
        from weights.plan import unpack_all

        start = time.perf_counter()
        handles = P.IpcHandles(ipc["uuid"], [P.IpcBuffer(**b) for b in ipc["buffers"]])
        if getattr(self, "_ipc", None) is None or self._ipc[0] != handles:
            self._ipc, self._copies = (handles, open_buffers(handles, manifest, self.device)), None
        flats = self._ipc[1]
        named = unpack_all(flats, manifest, buckets(manifest))
        note = self._in_step_gap(lambda: self._copy_in(manifest, named, flats))
        return [(time.perf_counter() - start) * 1000, note]
