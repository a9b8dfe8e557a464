"""Publish a weights version: gather (ZeRO-3: one parameter at a time), serialise, announce.

The blob is handed to the hub, which serves it in chunks to zmq generators; when a generator on this
host uses shm, the blob is also written to /dev/shm. Every rank must call `publish` (ZeRO-3
gathering is collective); only rank 0 serialises and announces.
"""

from __future__ import annotations

import time

from learner.model import gathered_weights
from pipeline import protocol as P
from pipeline.transports import checksum, serialize, write_shm


class WeightPublisher:
    def __init__(self, cfg, engine, hub, run_id: str, rank: int):
        self.cfg, self.engine, self.hub, self.run_id, self.rank = cfg, engine, hub, run_id, rank

    def publish(self, version: int, step_end: float | None = None) -> float:
        """Returns milliseconds from the call to the announcement."""
        start = time.perf_counter()
        named = gathered_weights(self.engine, self.cfg.trainer.zero_stage)
        if self.rank != 0:
            for _ in named:
                pass
            return 0.0
        blob = serialize(named)
        shm_path = ""
        if self.cfg.weights.transport == "shm" or self.hub.uses_transport("shm"):
            shm_path = write_shm(self.run_id, version, blob)
        ready = P.WeightsReady(version, len(blob), checksum(blob), shm_path, step_end or time.time())
        self.hub.publish(version, ready, blob)
        return (time.perf_counter() - start) * 1000
