"""Publish a weights version: gather (ZeRO-3: one parameter at a time), copy to CPU, announce.

On the learner's critical path: the gather, the nccl broadcasts to the generators (while gathering),
and one copy of each parameter into CPU buffers (pinned on GPU machines; two sets, alternating by
version, so the background thread can still read the previous one). The CPU copy serves generators
that join later: nccl joiners get it by broadcast (`_send_latest`), file transports (zmq, shm) as a
safetensors blob, which a background thread serialises, checksums and writes to /dev/shm while the
next step trains, only while some generator uses a file transport (or none is registered).
Every rank calls `publish` (ZeRO-3 gathering is collective); only rank 0 announces.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from learner.collective import manifest
from learner.model import gathered_weights
from pipeline import protocol as P
from pipeline.transports import checksum, serialize, write_shm


class WeightPublisher:
    def __init__(self, cfg, engine, hub, run_id: str, rank: int, collective=None):
        self.cfg, self.engine, self.hub, self.run_id, self.rank = cfg, engine, hub, run_id, rank
        self.collective = collective  # learner.collective.CollectivePeers (nccl transport) or None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._pending: Future | None = None
        self._buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, its CPU copy)
        self._lock = threading.Lock()  # the copy loop vs. sends to joiners and blob requests
        self.serialize_ms = 0.0  # of the last announced blob
        if rank == 0:
            if collective is not None:
                collective.on_join = self._send_latest
            hub.on_file_join = self.request_blob

    def publish(self, version: int, step_end: float | None = None) -> float:
        """Returns milliseconds on the learner's critical path: gathering, the nccl broadcasts, CPU copies."""
        start = time.perf_counter()
        step_end = step_end or time.time()
        peers = self.collective.ready() if self.collective is not None and self.rank == 0 else []
        sender = None
        if peers:  # the generators start receiving while the tensors are gathered and sent
            plan = manifest(self.engine.module.named_parameters())
            self.hub.announce(P.WeightsReady(version, 0, 0, "", step_end, collective=True, manifest=plan),
                              None, to=[p.generator_id for p in peers])
            sender = self.collective.sender(peers, plan)
        with self._lock:
            buffers = self._buffers[version % 2]
            for name, t in gathered_weights(self.engine, self.cfg.trainer.zero_stage):
                if self.rank == 0:
                    if sender is not None:
                        sender.add(t)
                    _copy_into(buffers, name, t)
            if sender is not None:
                sender.finish()
            if self.rank != 0:
                return 0.0
            if torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # the copies are complete before anyone reads them
            self._latest = (version, buffers)
        self.hub.finish_step(version)
        if self._pending is not None:
            self._pending.result()  # surfaces a failure of the previous announcement
            self._pending = None
        if self.hub.wants_blobs():
            self._pending = self._pool.submit(self._announce, version, buffers, step_end)
        return (time.perf_counter() - start) * 1000

    def _announce(self, version: int, buffers: dict, step_end: float) -> None:
        start = time.perf_counter()
        blob = serialize(buffers.items())
        shm_path = ""
        if self.cfg.weights.transport == "shm" or self.hub.uses_transport("shm"):
            shm_path = write_shm(self.run_id, version, blob)
        self.hub.announce(P.WeightsReady(version, len(blob), checksum(blob), shm_path, step_end), blob)
        self.serialize_ms = (time.perf_counter() - start) * 1000

    def request_blob(self) -> None:
        """A file-transport generator registered while the newest version has no blob (hub thread)."""
        self._pool.submit(self._announce_latest)

    def _announce_latest(self) -> None:
        with self._lock:  # holds the buffers of that version against the copy loop
            if self._latest is None:
                return
            version, buffers = self._latest
            last = self.hub.last_ready
            if last is None or last.version < version:
                self._announce(version, buffers, 0.0)

    def _send_latest(self, peer) -> None:
        """A generator joined its nccl group (rendezvous thread): broadcast it the current version."""
        with self._lock:
            if self._latest is None or self._latest[0] == peer.loaded_version:
                return
            version, buffers = self._latest
            plan = manifest(buffers.items())
            self.hub.announce(P.WeightsReady(version, 0, 0, "", 0.0, collective=True, manifest=plan), None,
                              to=[peer.generator_id])
            sender = self.collective.sender([peer], plan)
            for t in buffers.values():
                sender.add(t)
            sender.finish()

    def flush(self) -> None:
        """Wait until the last version is announced."""
        if self._pending is not None:
            self._pending.result()
        self._pool.shutdown(wait=True)


def _copy_into(buffers: dict, name: str, t: torch.Tensor) -> None:
    buf = buffers.get(name)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    buf.copy_(t, non_blocking=True)
