"""Publish a weights version: gather (ZeRO-3: one parameter at a time), serialise, announce.

Only the gather to CPU copies is on the learner's critical path; serialising, the crc32 and the
/dev/shm write run on a background thread (one at a time, so versions are announced in order) while
the next step trains. The hub serves the blob in chunks to zmq generators; when a generator on this
host uses shm, the blob is also written to /dev/shm. Every rank calls `publish` (ZeRO-3 gathering is
collective); only rank 0 announces. With the nccl transport, rank 0 also broadcasts each parameter to
the generators' process groups while it is gathered (`learner/collective.py`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

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
        self.serialize_ms = 0.0  # of the last announced version

    def publish(self, version: int, step_end: float | None = None) -> float:
        """Returns milliseconds on the learner's critical path: gathering, the nccl broadcasts, CPU copies."""
        start = time.perf_counter()
        step_end = step_end or time.time()
        peers = self.collective.ready() if self.collective is not None and self.rank == 0 else []
        if peers:  # the generators start receiving while the tensors are gathered and sent
            self.hub.announce(P.WeightsReady(version, 0, 0, "", step_end, collective=True,
                                             manifest=manifest(self.engine.module)), None)
        named = []
        for name, t in gathered_weights(self.engine, self.cfg.trainer.zero_stage):
            if self.rank == 0:
                if peers:
                    self.collective.send(peers, t)
                named.append((name, t.to("cpu", copy=True)))
        if self.rank != 0:
            return 0.0
        self.hub.finish_step(version)
        if self._pending is not None:
            self._pending.result()  # surfaces a failure of the previous announcement
        self._pending = self._pool.submit(self._announce, version, named, step_end)
        return (time.perf_counter() - start) * 1000

    def _announce(self, version: int, named: list, step_end: float) -> None:
        start = time.perf_counter()
        blob = serialize(named)
        shm_path = ""
        if self.cfg.weights.transport == "shm" or self.hub.uses_transport("shm"):
            shm_path = write_shm(self.run_id, version, blob)
        self.hub.announce(P.WeightsReady(version, len(blob), checksum(blob), shm_path, step_end), blob)
        self.serialize_ms = (time.perf_counter() - start) * 1000

    def flush(self) -> None:
        """Wait until the last version is announced."""
        if self._pending is not None:
            self._pending.result()
        self._pool.shutdown(wait=True)
