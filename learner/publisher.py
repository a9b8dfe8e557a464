"""Publish a weights version: gather (ZeRO-3: in groups of up to 256 MB), pack, send, copy to CPU, announce. What
a version holds is its kind's (learner/versions.py): every parameter, or with model.lora the adapter alone.

On the learner's critical path: the gather, packing each parameter into flat buckets of about 256 MB on
the learner's device (weights.plan.Packer), and handing each full bucket to the senders that take buckets
while a version is gathered (nccl: broadcast to the generators). Each bucket is then copied into CPU buffers
on a side CUDA stream (pinned; two sets, alternating by version), which nobody waits for until the copy is
read: training goes on meanwhile. The CPU copy serves the senders that want it (the file transports: a
safetensors blob serialised, checksummed and written while the next step trains) and generators that join
later (`latest`). The senders are weights/__init__.py's, built by the learner (rank 0's; the hub holds them too, to
tell them who joins). Every rank calls `publish` (ZeRO-3 gathering is collective); only rank 0 sends. The training
loop, not the publisher, ends a step (Hub.finish_step)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from learner.model import free_gpu_bytes
from learner.versions import version_kind
from weights.base import Sender
from weights.plan import Packer, manifest, nbytes, unpack

INFLIGHT_BYTES = 2 * 2**30  # device buckets held for their CPU copy: at least this much, and up to half the
# device memory free at the version's start (past it they are copied at once, and the learner waits)


class WeightPublisher:
    def __init__(self, cfg, engine, senders: Iterable[Sender], rank: int):
        """`senders`: rank 0's (weights.senders' values), none on other ranks."""
        self.cfg, self.engine, self.rank = cfg, engine, rank
        self.kind = version_kind(cfg, engine.module)  # every parameter, or a LoRA adapter alone
        self.version_bytes = 0  # of the last version: what it carries (an adapter run: the adapter's bytes)
        self.senders = list(dict.fromkeys(senders))  # each once: one FileSender serves both shm and zmq
        self.device = next((s.device for s in self.senders if s.device is not None), None) or _device(engine)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._pending: list[Future] = []
        self._buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self._latest: tuple | None = None  # (version, its CPU copy, event: copy complete)
        self._copy = HostCopy()
        self.broadcast_ms = 0.0  # of the last version: handing buckets to the senders (nccl: the broadcasts)
        self.copy_wait_ms = 0.0  # of the last version: waiting for CPU copies to free device buckets
        self._lock = threading.Lock()  # the copy loop vs. sends to joiners
        for sender in self.senders:
            sender.latest = self.latest

    def publish(self, version: int, step_end: float | None = None) -> float:
        """Returns milliseconds on the learner's critical path: gathering, packing, the buckets' sends."""
        start = time.perf_counter()
        step_end = step_end or time.time()
        plan = manifest(self.kind.named())
        self.version_bytes = sum(nbytes(dtype, shape) for _, dtype, shape in plan)
        live = [s for s in self.senders if s.begin(version, plan, step_end)]  # they start receiving meanwhile
        try:
            if not self._gather(version, plan, live):
                return 0.0
        finally:
            for sender in live:
                sender.end()  # also when the gather failed: nothing waits on a version that never ends
        assert self._latest is not None  # the gather made it
        _, buffers, copied = self._latest
        for pending in self._pending:
            pending.result()  # surfaces a failure of the previous version's sends
        self._pending = [self._pool.submit(self._send, s, version, buffers, copied, step_end)
                         for s in self.senders if s.wanted()]
        return (time.perf_counter() - start) * 1000

    def _gather(self, version: int, plan: list, live: list) -> bool:
        """Gather and pack the version, hand each bucket to the `live` senders, and start its CPU copy; False on a
        rank other than 0 (it takes part in the gathers only)."""
        self.broadcast_ms = 0.0
        with self._lock:
            buffers = self._buffers[version % 2]

            def emit(flat, idx, offs):
                t = time.perf_counter()
                for sender in live:
                    sender.bucket(flat)
                self.broadcast_ms += (time.perf_counter() - t) * 1000
                self._copy.store(buffers, unpack(flat, plan, idx, offs), flat)

            self._copy.begin(self.device)
            packer = Packer(plan, self.device, emit)
            for _, t in self.kind.gathered(self.engine, self.cfg.trainer.zero_stage):
                if self.rank == 0:
                    packer.add(t)
            if self.rank != 0:
                return False
            packer.finish()
            self._latest = (version, buffers, self._copy.seal())
            self.copy_wait_ms = self._copy.waited_ms
        return True

    def metrics(self) -> dict:
        """Of the last version (a background send: of the last one done)."""
        out = {"sync/broadcast_ms": self.broadcast_ms, "sync/copy_wait_ms": self.copy_wait_ms,
               "sync/version_bytes": self.version_bytes}
        for sender in self.senders:
            out.update(sender.metrics())
        return out

    def _send(self, sender, version: int, buffers: dict, copied, step_end: float) -> None:
        _wait(copied)
        sender.send(version, list(buffers.items()), step_end)

    def latest(self, fn, background: bool = False) -> None:
        """fn(version, named) with the newest version's CPU copy, held against the copy loop meanwhile: for a
        generator that joins (nccl: on the rendezvous thread; `background`: on the publisher's)."""
        if background:
            self._pool.submit(self.latest, fn)
            return
        with self._lock:
            if self._latest is None:
                return
            version, buffers, copied = self._latest
            _wait(copied)
            fn(version, list(buffers.items()))

    def flush(self) -> None:
        """Wait until the last version is sent."""
        for pending in self._pending:
            pending.result()
        self._pool.shutdown(wait=True)


class HostCopy:
    """Copies of a version's buckets into per-parameter CPU buffers, started once its gathers are done: under
    ZeRO-3 every gather ends in a device-wide synchronize (DeepSpeed's), which would wait for copies already
    running (7B: 15 GB over PCIe, about 280 ms of each version on the learner's path). On a GPU the copies
    run on a side stream into pinned buffers: `seal` returns an event that readers wait for, the learner
    does not. Buckets are held on the device until then, up to `limit` bytes (past it: copied at once,
    and waited for)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.held: list[tuple[dict, list, torch.Tensor]] = []  # (buffers, [(name, view)], bucket): not copied yet
        self.limit, self.waited_ms = INFLIGHT_BYTES, 0.0

    def begin(self, device) -> None:
        """A version starts: buckets may hold up to half the free device memory (the caching allocator's
        unused blocks included, within trainer.gpu_memory_gb), at least INFLIGHT_BYTES."""
        self.waited_ms = 0.0
        if self.stream is None or torch.device(device).type != "cuda":
            return
        self.limit = max(INFLIGHT_BYTES, free_gpu_bytes(device) // 2)

    def store(self, buffers: dict, named: list, flat: torch.Tensor) -> None:
        self.held.append((buffers, named, flat))
        if sum(f.numel() * f.element_size() for *_, f in self.held) > self.limit:
            t = time.perf_counter()
            self._copy()
            if self.stream is not None:
                self.stream.synchronize()
            self.waited_ms += (time.perf_counter() - t) * 1000

    def seal(self):
        """Start the copies of the buckets held; an event for all copies (None on CPU, where they are done)."""
        self._copy()
        return self.stream.record_event() if self.stream is not None else None

    def _copy(self) -> None:
        held, self.held = self.held, []
        if self.stream is None or not held or not held[0][2].is_cuda:
            for buffers, named, _ in held:
                for name, t in named:
                    _buffer(buffers, name, t).copy_(t)
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # the buckets are packed
        with torch.cuda.stream(self.stream):
            for buffers, named, flat in held:
                for name, t in named:
                    _buffer(buffers, name, t).copy_(t, non_blocking=True)
                flat.record_stream(self.stream)  # its memory is not reused before the copies are done


def _wait(copied) -> None:
    if copied is not None:
        copied.synchronize()


def _device(engine):
    return engine.device if torch.cuda.is_available() else "cpu"


def _buffer(buffers: dict, name: str, t: torch.Tensor) -> torch.Tensor:
    buf = buffers.get(name)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return buf
