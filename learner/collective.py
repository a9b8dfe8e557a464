"""The learner's side of the `nccl` weight transport: one process group per generator.

At registration the hub opens a TCPStore for the generator and tells it the port; the learner (rank 0
of that group) and the generator's workers (ranks 1..tensor_parallel) meet there, so generators can
join at any time. Joining ends with a one-element broadcast (the communicator really exists), then the
joiner is sent the current version from the learner's CPU copy (`on_join`), and from then on every new
version is broadcast while it is gathered (ZeRO-3: in groups of up to 256 MB), straight from the learner's
GPU to the generators' GPUs, packed into flat buckets of about 256 MB (a few broadcasts per version, not
one per parameter; both sides derive the same plan from the announced manifest). On CPU machines the
same groups run over gloo, which is how the tests exercise this path.
"""

from __future__ import annotations

import datetime
import logging
import math
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def make_group(store, rank: int, world: int, backend: str, timeout_s: float, device=None):
    """A process group on `store`, checked with one broadcast from rank 0 (NCCL creates its communicator
    lazily: without it a rank that never comes would only be noticed at the first real broadcast)."""
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s + 30)  # the watchdog fires after our own wait
        group = dist.ProcessGroupNCCL(store, rank, world, opts)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))
    probe = torch.ones(1, device=device if backend == "nccl" else "cpu")
    group.broadcast(probe, 0).wait(datetime.timedelta(seconds=timeout_s))
    return group


def abort(group) -> None:
    """Tear down a group whose peer failed (NCCL would otherwise keep its pending work)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # best effort: the peer is gone either way
                pass
            return


class Peer:
    def __init__(self, generator_id: str, store, world: int, loaded_version: int):
        self.generator_id, self.store, self.world, self.loaded_version = generator_id, store, world, loaded_version
        self.group = None
        self.ready = False  # joined and holding the current version: new versions are broadcast to it
        self.failed = False


class CollectivePeers:
    def __init__(self, host: str, timeout_s: float):
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        self.host, self.timeout_s = host, timeout_s
        self.lock = threading.Lock()
        self.peers: dict[str, Peer] = {}
        self.failed: set[str] = set()  # generators whose group failed: `auto` gives them a file transport
        self.on_join = None  # callable(peer): send the current version (set by the weight publisher)

    def open(self, generator_id: str, world: int, loaded_version: int = -1) -> dict:
        """Called by the hub at registration: a store for the rendezvous, joined in the background."""
        self.close(generator_id)
        store = dist.TCPStore(self.host, 0, world, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                              wait_for_workers=False)
        peer = Peer(generator_id, store, world, loaded_version)
        with self.lock:
            self.peers[generator_id] = peer
        threading.Thread(target=self._connect, args=(peer,), daemon=True, name=f"rendezvous-{generator_id}").start()
        return {"port": store.port, "world_size": world, "backend": self.backend, "timeout_s": self.timeout_s}

    def _connect(self, peer: Peer) -> None:
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            peer.group = make_group(peer.store, 0, peer.world, self.backend, self.timeout_s, self.device)
            if self.on_join is not None:
                self.on_join(peer)
        except Exception as e:  # the generator never came: it re-registers (auto: with a file transport)
            self._fail(peer, f"did not join its process group: {e}")
            return
        if peer.failed:  # closed while it joined
            abort(peer.group)
            return
        peer.ready = True
        log.info("nccl transport: %s joined (%s, %d ranks)", peer.generator_id, self.backend, peer.world)

    def _fail(self, peer: Peer, why: str) -> None:
        log.warning("nccl transport: %s %s; dropped", peer.generator_id, why)
        self.failed.add(peer.generator_id)
        self._drop(peer)
        if peer.group is not None:
            abort(peer.group)

    def close(self, generator_id: str) -> None:
        """Forget a generator's group (it drains, left, went silent or registers again) and abort the group in
        a thread of its own: a broadcast already sent to a peer that stopped receiving ends, instead of
        holding the learner until that generator's process exits."""
        with self.lock:
            peer = self.peers.get(generator_id)
        if peer is not None and self._drop(peer) and peer.group is not None:
            threading.Thread(target=abort, args=(peer.group,), daemon=True, name=f"abort-{generator_id}").start()

    def _drop(self, peer: Peer) -> bool:
        """Take `peer` (not a newer one under its id) out of the broadcasts; False if it already was."""
        with self.lock:
            if self.peers.get(peer.generator_id) is peer:
                del self.peers[peer.generator_id]
            was_live, peer.failed = not peer.failed, True  # send() skips it from the next bucket on
        return was_live

    def is_ready(self, generator_id: str) -> bool:
        with self.lock:
            peer = self.peers.get(generator_id)
            return peer is not None and peer.ready

    def ready(self) -> list[Peer]:
        with self.lock:
            return [p for p in self.peers.values() if p.ready and not p.failed]

    def send(self, peers: list[Peer], t: torch.Tensor) -> None:
        """Broadcast a bucket (on this backend's device) to every peer; a peer that fails is dropped (it
        will re-register)."""
        for peer in peers:
            if peer.failed:
                continue
            try:
                peer.group.broadcast(t, 0).wait(datetime.timedelta(seconds=self.timeout_s))
            except Exception as e:
                if not peer.failed:  # not closed meanwhile (a closed group's broadcasts fail by design)
                    self._fail(peer, f"broadcast failed ({e})")


# ---- buckets: a version travels as a few flat broadcasts, not one per parameter ---------------------

BUCKET_BYTES = 256 * 2**20
ALIGN = 16  # every tensor starts at a multiple of this many bytes inside its bucket


def _nbytes(dtype: str, shape: list) -> int:
    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def buckets(manifest: list) -> list[tuple[list[int], list[int], int]]:
    """Consecutive manifest entries grouped into broadcasts of about BUCKET_BYTES (a larger tensor alone):
    [(entry indices, their byte offsets, bucket size)]. Learner and generators compute the same plan."""
    plan, idx, offs, size = [], [], [], 0
    for i, (_, dtype, shape) in enumerate(manifest):
        idx.append(i)
        offs.append(size)
        size += -(-_nbytes(dtype, shape) // ALIGN) * ALIGN
        if size >= BUCKET_BYTES:
            plan.append((idx, offs, size))
            idx, offs, size = [], [], 0
    if idx:
        plan.append((idx, offs, size))
    return plan


def unpack(flat: torch.Tensor, manifest: list, idx: list[int], offs: list[int]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received bucket."""
    out = []
    for i, off in zip(idx, offs, strict=True):
        name, dtype, shape = manifest[i]
        n = _nbytes(dtype, shape)
        out.append((name, flat[off:off + n].view(getattr(torch, dtype)).view(shape)))
    return out


class Packer:
    """Copies tensors (in manifest order, as they are gathered) into flat buckets on `device`; each full bucket
    goes to `emit(flat, idx, offs)` (broadcast, CPU copy). ZeRO-3 may release a parameter once it is added:
    the copy is queued on the current stream, ahead of any reuse of its memory."""

    def __init__(self, manifest: list, device, emit):
        self.plan, self.device, self.emit = buckets(manifest), device, emit
        self.k, self.n, self.flat = 0, 0, None

    def add(self, t: torch.Tensor) -> None:
        idx, offs, size = self.plan[self.k]
        if self.flat is None:
            self.flat = torch.empty(size, dtype=torch.uint8, device=self.device)
        nbytes = t.numel() * t.element_size()
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        self.flat[offs[self.n]:offs[self.n] + nbytes].copy_(src, non_blocking=True)
        self.n += 1
        if self.n == len(idx):
            self.emit(self.flat, idx, offs)
            self.k, self.n, self.flat = self.k + 1, 0, None

    def finish(self) -> None:
        if self.k != len(self.plan):  # the generators would wait for the rest until their timeout
            raise RuntimeError(f"nccl transport: {self.k} of {len(self.plan)} buckets sent; parameters differ "
                               "from the announced manifest")


def manifest(named) -> list[list]:
    """[name, dtype, shape] of (name, tensor) pairs in broadcast order (ZeRO-3 parameters: the full shape)."""
    return [[name, str(t.dtype).removeprefix("torch."), list(getattr(t, "ds_shape", t.shape))] for name, t in named]
