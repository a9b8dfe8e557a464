"""A toy weight transport: what adding one takes is this file and its line in pipeline/transports.py
(tests/unit/test_toy_transport.py adds the line). The learner and the generator share a process here, so a version's
tensors wait on a shelf; its announcement names the version and its manifest, as nccl's does."""

from __future__ import annotations

import time

from pipeline import protocol as P
from weights.base import Engine, Receiver, Sender, Worker
from weights.plan import manifest

SHELF: dict[int, list] = {}  # version: its (name, tensor) pairs


class ShelfSender(Sender):
    def __init__(self, cfg, hub, run_id: str):
        super().__init__(cfg, hub, run_id)
        self.generators: dict[str, bytes] = {}  # generator id: its connection

    def join(self, register: P.Register, ident: bytes, version: int) -> None:
        self.generators[register.generator_id] = ident
        if SHELF:  # the newest version right after the Welcome (hub thread, lock held: pushed, not announced)
            newest = max(SHELF)
            self.announcer.push(ident, P.WeightsReady(newest, manifest=manifest(SHELF[newest])))

    def leave(self, generator_id: str, again: bool = False) -> None:
        self.generators.pop(generator_id, None)

    def wanted(self) -> bool:
        return True

    def send(self, version: int, named, published_at: float) -> None:
        SHELF[version] = list(named)
        self.announcer.announce(P.WeightsReady(version, published_at, manifest=manifest(SHELF[version])), None,
                          to=list(self.generators))


class ShelfReceiver(Receiver):
    name = via = "toy"
    in_order = True

    def accepts(self, ready: P.WeightsReady) -> bool:
        return bool(ready.manifest) and ready.ipc is None

    async def apply(self, ready: P.WeightsReady, engine: Engine) -> float:
        return await engine.swap(ready.version, "load_from_shelf", ready.version)


class ShelfWorker(Worker):
    def load_from_shelf(self, version: int) -> list:
        start = time.perf_counter()
        self._in_step_gap(lambda: self._load_named(SHELF[version]))
        return [(time.perf_counter() - start) * 1000, ""]
