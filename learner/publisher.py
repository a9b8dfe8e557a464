"""Publish a weights version: gather (ZeRO-3: in groups of up to 256 MB), pack, broadcast, copy to CPU, announce.

On the learner's critical path: the gather, packing each parameter into flat buckets of about 256 MB on
the learner's device (weights.plan.Packer), and the nccl broadcast of each full bucket to the
generators. Each bucket is then copied into CPU buffers on a side CUDA stream (pinned; two sets,
alternating by version), which nobody waits for until the copy is read: training goes on meanwhile.
The CPU copy serves generators that join later: nccl joiners get it by broadcast (`_send_latest`), file
transports (zmq, shm) as a safetensors blob, which a background thread serialises, checksums and writes
to /dev/shm while the next step trains (weights.files.FileSender), only while some generator uses a file
transport (or none is registered). Every rank calls `publish` (ZeRO-3 gathering is collective); only rank 0
announces. The training loop, not the publisher, ends a step (Hub.finish_step)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from learner.model import gathered_weights
from pipeline import protocol as P
from weights.files import FileSender
from weights.plan import Packer, manifest, unpack

INFLIGHT_BYTES = 2 * 2**30  # device buckets held for their CPU copy: at least this much, and up to half the
# device memory free at the version's start (past it they are copied at once, and the learner waits)


class WeightPublisher:
    def __init__(self, cfg, engine, hub, run_id: str, rank: int, collective=None):
        self.cfg, self.engine, self.hub, self.run_id, self.rank = cfg, engine, hub, run_id, rank
        self.collective = collective  # weights.nccl.CollectivePeers (nccl transport) or None
        self.files = FileSender(hub, run_id, cfg.weights.transport, cfg.weights.delta) if rank == 0 else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._pending: Future | None = None
        self._buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self._latest: tuple | None = None  # (version, its CPU copy, event: copy complete)
        self._copy = HostCopy()
        self.broadcast_ms = 0.0  # of the last version: the nccl broadcasts alone
        self.copy_wait_ms = 0.0  # of the last version: waiting for CPU copies to free device buckets
        self._lock = threading.Lock()  # the copy loop vs. sends to joiners and blob requests
        if rank == 0:
            if collective is not None:
                collective.on_join = self._send_latest
            hub.weights.on_file_join = self.request_blob

    def publish(self, version: int, step_end: float | None = None) -> float:
        """Returns milliseconds on the learner's critical path: gathering, packing, the nccl broadcasts."""
        start = time.perf_counter()
        step_end = step_end or time.time()
        peers = self.collective.ready() if self.collective is not None and self.rank == 0 else []
        plan = manifest(self.engine.module.named_parameters())
        if peers:  # the generators start receiving while the tensors are gathered and sent
            self.hub.announce(P.WeightsReady(version, step_end, manifest=plan), None,
                              to=[p.generator_id for p in peers])
        self.broadcast_ms = 0.0
        with self._lock:
            buffers = self._buffers[version % 2]

            def emit(flat, idx, offs):
                if peers:
                    t = time.perf_counter()
                    self.collective.send(peers, flat)
                    self.broadcast_ms += (time.perf_counter() - t) * 1000
                self._copy.store(buffers, unpack(flat, plan, idx, offs), flat)

            device = (self.collective.device if self.collective is not None else None) or _device(self.engine)
            self._copy.begin(device)
            packer = Packer(plan, device, emit)
            for _, t in gathered_weights(self.engine, self.cfg.trainer.zero_stage):
                if self.rank == 0:
                    packer.add(t)
            if self.rank != 0:
                return 0.0
            packer.finish()
            self._latest = (version, buffers, self._copy.seal())
            self.copy_wait_ms = self._copy.waited_ms
        if self._pending is not None:
            self._pending.result()  # surfaces a failure of the previous announcement
            self._pending = None
        if self.files.wanted():
            self._pending = self._pool.submit(self._announce, version, buffers, self._latest[2], step_end)
        return (time.perf_counter() - start) * 1000

    @property
    def serialize_ms(self) -> float:
        """Of the last announced blob."""
        return self.files.serialize_ms if self.files is not None else 0.0

    def _announce(self, version: int, buffers: dict, copied, step_end: float) -> None:
        _wait(copied)
        self.files.send(version, buffers.items(), step_end)

    def request_blob(self) -> None:
        """A file-transport generator registered while the newest version has no blob (hub thread)."""
        self._pool.submit(self._announce_latest)

    def _announce_latest(self) -> None:
        with self._lock:  # holds the buffers of that version against the copy loop
            if self._latest is None:
                return
            version, buffers, copied = self._latest
            last = self.hub.weights.last_ready
            if last is None or last.version < version:
                self._announce(version, buffers, copied, 0.0)

    def _send_latest(self, peer) -> None:
        """A generator joined its nccl group (rendezvous thread): broadcast it the current version."""
        with self._lock:
            if self._latest is None or self._latest[0] == peer.loaded_version:
                return
            version, buffers, copied = self._latest
            _wait(copied)
            plan = manifest(buffers.items())
            self.hub.announce(P.WeightsReady(version, manifest=plan), None, to=[peer.generator_id])
            packer = Packer(plan, self.collective.device or "cpu",
                            lambda flat, idx, offs: self.collective.send([peer], flat))
            for t in buffers.values():
                packer.add(t)
            packer.finish()

    def flush(self) -> None:
        """Wait until the last version is announced."""
        if self._pending is not None:
            self._pending.result()
        self._pool.shutdown(wait=True)


class HostCopy:
    """Copies of a version's buckets into per-parameter CPU buffers, started once its gathers are done: under
    ZeRO-3 every gather ends in a device-wide synchronize (DeepSpeed's), which would wait for copies already
    running (7B: 15 GB over PCIe, about 280 ms of each version on the learner's path). On a GPU the copies
    run on a side stream into pinned buffers: `seal` returns an event that readers wait for, the learner
    does not. Buckets are held on the device until then, up to `limit` bytes (past it: copied at once,
    and waited for)."""

    def __init__(self):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.held: list[tuple[dict, list, torch.Tensor]] = []  # (buffers, [(name, view)], bucket): not copied yet
        self.limit, self.waited_ms = INFLIGHT_BYTES, 0.0

    def begin(self, device) -> None:
        """A version starts: buckets may hold up to half the free device memory (the caching allocator's
        unused blocks included), at least INFLIGHT_BYTES."""
        self.waited_ms = 0.0
        if self.stream is None or torch.device(device).type != "cuda":
            return
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)
        self.limit = max(INFLIGHT_BYTES, free // 2)

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
