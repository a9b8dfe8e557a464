"""The hub's side of the weight transports (it runs under the hub's lock, on the hub's thread or the learner's).

The senders are the learner's: it builds them (weights.senders, with the hub as their Announcer), its publisher
drives them, and the hub holds them by transport (Hub.serve_weights) to tell them who joins and leaves.
At registration: the generator's transport (`weights.pick`) and its sender's `join` (an nccl group opened, or
the newest file version pushed right after the Welcome). Each new version: the announcement pushed to the
generators it concerns (a file version to every generator of a file transport, a broadcast to the ones the
broadcasts will reach), its blob kept for zmq pulls, which are served chunk by chunk to registered generators,
a few chunks in flight each (a version being pulled is kept until its generator applies a version or leaves).
"""

from __future__ import annotations

import mmap

from hub.registry import GeneratorInfo, Registry
from hub.server import Server
from pipeline import protocol as P
from pipeline.config import Config
from pipeline.environment import env_flag
from pipeline.host import host_identity
from weights import pick, shares_gpu
from weights.base import Sender
from weights.zmq import Blobs

CHUNKS_IN_FLIGHT = 5  # weight chunks per peer not yet handed to the network (the generator keeps 4 in flight)


class WeightServing:
    def __init__(self, cfg: Config, registry: Registry, server: Server, version: int) -> None:
        self.cfg, self.registry, self.server = cfg, registry, server
        self.newest = version  # announced: a rollout may already come from it
        self.last_ready: P.WeightsReady | None = None  # the newest file version
        self.blobs = Blobs(cfg.weights.chunk_mb * 2**20)
        self.senders: dict[str, Sender] = {}  # by transport: the learner's (Hub.serve_weights)
        self._host = host_identity()[1]  # boot id, network namespace, /dev/shm: which generators share a host

    def published(self, version: int) -> int:
        """The newest version announced, or trained (`version`, the hub's): no engine can hold a newer one."""
        return max(version, self.newest)

    def join(self, msg: P.Register, ident: bytes, version: int) -> tuple[str, P.CollectiveSetup | None]:
        """A generator registers: (its transport, its setup from the sender). ValueError: no sender for it here."""
        visible = env_flag("CUDA_VISIBLE_DEVICES")  # rank 0's device is the one in the nccl groups
        transport = pick(self.cfg.weights.transport, msg, self._host, visible.split(",")[:1] if visible else ["0"],
                         self.senders)
        sender = self.senders.get(transport)
        if sender is None:
            raise ValueError(f"weights.transport {transport}: this learner cannot send it (it has "
                             f"{', '.join(self.senders) or 'none'})")
        return transport, sender.join(msg, ident, version)

    def on_learner_gpus(self, msg: P.Register) -> bool:
        """The generator shares a GPU with one of the learner's ranks (CUDA_VISIBLE_DEVICES: all of theirs; GPU 0
        when unset, none for a learner on CPU), whose time the two take in turns: the verdict names it
        (pipeline/verdict.py)."""
        import torch

        visible = env_flag("CUDA_VISIBLE_DEVICES")
        learner = visible.split(",") if visible else ["0"] if torch.cuda.is_available() else []
        return shares_gpu(msg, self._host, learner)

    def leave(self, generator_id: str, again: bool = False) -> None:
        """It drains, left, went silent, or registers again (`again`)."""
        self.blobs.done(generator_id)
        for sender in set(self.senders.values()):
            sender.leave(generator_id, again)

    def shutdown(self) -> None:
        """The run ends: the senders release what they hold outside the process."""
        for sender in set(self.senders.values()):
            sender.shutdown()

    def applied(self, generator_id: str, version: int) -> None:
        self.blobs.done(generator_id)  # its pull, if any, has ended
        for sender in set(self.senders.values()):
            sender.on_applied(generator_id, version)

    def announce(self, ready: P.WeightsReady, blob: bytes | bytearray | mmap.mmap | None, to: list[str] | None,
                 delta: bytes | None = None, transports: set[str] | None = None) -> None:
        """A file version goes to every generator of `transports` (None: every one); a broadcast to those in `to`."""
        self.newest = max(self.newest, ready.version)
        if blob is not None:
            self.blobs.put(ready.version, blob, delta)
        gens = self.registry.generators
        if ready.file is not None:  # to every file-transport generator (a later one gets it after its Welcome)
            self.last_ready = ready
            to = [g.generator_id for g in gens.values() if transports is None or g.transport in transports]
        data = P.encode(ready)  # on the control channel: reliable, in order with what follows
        for g in to or []:
            if g in gens:
                self.server.push(gens[g].ident, data)

    def chunk(self, msg: P.WeightsFetch, gen: GeneratorInfo, version: int) -> P.Message:
        if self.server.chunks_in_flight(gen.ident) >= CHUNKS_IN_FLIGHT:
            return P.Error(f"weights: more than {CHUNKS_IN_FLIGHT} chunks of {self.cfg.weights.chunk_mb} MB in "
                           "flight to this generator")
        return self.blobs.chunk(msg, gen.generator_id, version)
