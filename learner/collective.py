"""The learner's side of the `nccl` weight transport: one process group per generator.

At registration the hub opens a TCPStore for the generator and tells it the port; the learner (rank 0
of that group) and the generator's workers (ranks 1..tensor_parallel) meet there, so generators can
join at any time. Each new version is broadcast parameter by parameter while it is gathered (ZeRO-3:
one parameter at a time), straight from the learner's GPU to the generators' GPUs. On CPU machines the
same groups run over gloo, which is how the tests exercise this path.
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def make_group(store, rank: int, world: int, backend: str, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


class Peer:
    def __init__(self, generator_id: str, store, world: int):
        self.generator_id, self.store, self.world = generator_id, store, world
        self.group = None
        self.failed = False


class CollectivePeers:
    def __init__(self, host: str, timeout_s: float):
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.host, self.timeout_s = host, timeout_s
        self.lock = threading.Lock()
        self.peers: dict[str, Peer] = {}

    def open(self, generator_id: str, world: int) -> dict:
        """Called by the hub at registration: a store for the rendezvous, joined in the background."""
        self.close(generator_id)
        store = dist.TCPStore(self.host, 0, world, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                              wait_for_workers=False)
        peer = Peer(generator_id, store, world)
        with self.lock:
            self.peers[generator_id] = peer
        threading.Thread(target=self._connect, args=(peer,), daemon=True, name=f"rendezvous-{generator_id}").start()
        return {"port": store.port, "world_size": world, "backend": self.backend, "timeout_s": self.timeout_s}

    def _connect(self, peer: Peer) -> None:
        try:
            group = make_group(peer.store, 0, peer.world, self.backend, self.timeout_s)
        except Exception as e:  # the generator never came: it re-registers and gets a new group
            log.warning("nccl transport: %s did not join its process group: %s", peer.generator_id, e)
            peer.failed = True
            return
        with self.lock:
            peer.group = group
        log.info("nccl transport: %s joined (%s, %d ranks)", peer.generator_id, self.backend, peer.world)

    def close(self, generator_id: str) -> None:
        with self.lock:
            self.peers.pop(generator_id, None)

    def ready(self) -> list[Peer]:
        with self.lock:
            return [p for p in self.peers.values() if p.group is not None and not p.failed]

    def send(self, peers: list[Peer], tensor: torch.Tensor) -> None:
        """Broadcast one tensor to every ready peer; a peer that fails is dropped (it will re-register)."""
        t = tensor if self.backend == "nccl" else tensor.detach().to("cpu")
        for peer in peers:
            if peer.failed:
                continue
            try:
                peer.group.broadcast(t.contiguous(), 0).wait(datetime.timedelta(seconds=self.timeout_s))
            except Exception as e:
                log.warning("nccl transport: broadcast to %s failed (%s); dropped", peer.generator_id, e)
                peer.failed = True
                self.close(peer.generator_id)


def manifest(module) -> list[list]:
    """[name, dtype, shape] of every parameter in broadcast order (ZeRO-3: the full shape)."""
    out = []
    for name, p in module.named_parameters():
        shape = list(getattr(p, "ds_shape", p.shape))
        out.append([name, str(p.dtype).removeprefix("torch."), shape])
    return out
