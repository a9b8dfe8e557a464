"""The hub's side of the weight transports (it runs under the hub's lock, on the hub's thread or the learner's).

At registration: the generator's transport (`weights.pick`), its nccl group opened, or the newest file version
pushed right after its Welcome. Each new version: the announcement pushed to the generators it concerns (a
file version to every file-transport generator, a broadcast to the ones the broadcasts will reach), its blob
kept for zmq pulls, which are served chunk by chunk to registered generators, a few chunks in flight each.
"""

from __future__ import annotations

import os

from pipeline import protocol as P
from weights import pick
from weights.files import host_identity
from weights.zmq import Blobs

CHUNKS_IN_FLIGHT = 5  # weight chunks per peer not yet handed to the network (the generator keeps 4 in flight)


class WeightServing:
    def __init__(self, cfg, registry, server, collective, run_id: str, version: int):
        self.cfg, self.registry, self.server, self.collective, self.run_id = cfg, registry, server, collective, run_id
        self.newest = version  # announced: a rollout may already come from it
        self.last_ready: P.WeightsReady | None = None  # the newest file version
        self.blobs = Blobs(cfg.weights.chunk_mb * 2**20)
        self.on_file_join = None  # callable(): a file-transport generator needs a blob of the newest version
        self._boot_id = host_identity()[1]

    def join(self, msg: P.Register, ident: bytes, version: int) -> tuple[str, P.CollectiveSetup | None]:
        """A generator registers: (its transport, its nccl setup). Raises ValueError if nccl cannot be had."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # rank 0's device is the one in the nccl groups
        transport = pick(self.cfg.weights.transport, msg, self._boot_id, visible.split(",")[:1] if visible else ["0"],
                         self.collective)
        if transport == "nccl":
            if self.collective is None:
                raise ValueError("weights.transport nccl: this learner has no collective transport")
            loaded = msg.loaded_version if msg.loaded_run == self.run_id else -1  # weights of another run: resend
            # the current version comes by broadcast once the group is joined
            return transport, P.CollectiveSetup(**self.collective.open(msg.generator_id, 1 + msg.tensor_parallel,
                                                                       loaded))
        if self.last_ready is not None:  # after the Welcome, on the one route versions take
            self.server.push(ident, P.encode(self.last_ready))
        if self.on_file_join is not None and (self.last_ready is None or self.last_ready.version < version):
            self.on_file_join()  # versions were published by broadcast only: make a blob of the newest
        return transport, None

    def leave(self, generator_id: str, gave_up: bool = False) -> None:
        """Its nccl group closes (it drains, left, went silent, or registers again: `gave_up` on its group)."""
        if self.collective is None:
            return
        if gave_up and not self.collective.is_ready(generator_id):
            self.collective.failed.add(generator_id)  # `auto` gives it a file transport next time
        self.collective.close(generator_id)

    def announce(self, ready: P.WeightsReady, blob: bytes | None, to: list[str] | None,
                 delta: bytes | None = None) -> None:
        self.newest = max(self.newest, ready.version)
        if blob is not None:
            self.blobs.put(ready.version, blob, delta)
        gens = self.registry.generators
        if ready.file is not None:  # to every file-transport generator (a later one gets it after its Welcome)
            self.last_ready = ready
            to = [g.generator_id for g in gens.values() if g.transport != "nccl"]
        data = P.encode(ready)  # on the control channel: reliable, in order with what follows
        for g in to or []:
            if g in gens:
                self.server.push(gens[g].ident, data)

    def chunk(self, msg: P.WeightsFetch, gen, version: int) -> P.Message:
        if self.server.chunks_in_flight(gen.ident) >= CHUNKS_IN_FLIGHT:
            return P.Error(f"weights: more than {CHUNKS_IN_FLIGHT} chunks of {self.cfg.weights.chunk_mb} MB in "
                           "flight to this generator")
        return self.blobs.chunk(msg, version)
