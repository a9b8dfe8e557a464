"""The nccl transport's learner side in process (weights/nccl.py, weights/plan.py): buckets carry every tensor bit
exact, a closed or silent generator leaves the broadcasts without holding the learner, and registrations that come
and go leave nothing behind."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from weights.plan import manifest


def test_nccl_buckets_carry_every_tensor_bit_exact(monkeypatch):
    """The learner packs parameters into a few flat broadcasts; the generator's plan, computed from the same
    manifest, unpacks them into the same names, dtypes, shapes and values."""
    import torch

    from weights import plan as C

    monkeypatch.setattr(C, "BUCKET_BYTES", 1000)
    named = [("a", torch.randn(3, 5, dtype=torch.bfloat16)), ("b", torch.arange(7, dtype=torch.int64)),
             ("big", torch.randn(40, 10)), ("c", torch.randn(1, dtype=torch.bfloat16)), ("d", torch.randn(2, 3))]
    plan = C.manifest(named)
    assert plan[0] == ["a", "bfloat16", [3, 5]]
    groups = C.buckets(plan)
    assert [g[0] for g in groups] == [[0, 1, 2], [3, 4]]  # "big" (1600 bytes) closes the first bucket
    assert all(off % C.ALIGN == 0 for _, offs, _ in groups for off in offs)

    sent = []
    packer = C.Packer(plan, "cpu", lambda flat, idx, offs: sent.append(flat.clone()))
    for _, t in named:
        packer.add(t)
    packer.finish()
    assert len(sent) == 2
    got = [x for flat, (idx, offs, _) in zip(sent, groups, strict=True) for x in C.unpack(flat, plan, idx, offs)]
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, t) in zip(named, got, strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    short = C.Packer(plan, "cpu", sent.append)
    short.add(named[0][1])
    with pytest.raises(RuntimeError, match="0 of 2 buckets"):
        short.finish()


class FakeGroup:
    """A process group that records broadcasts and aborts; `on_broadcast` runs while a broadcast is waited for."""

    def __init__(self, on_broadcast=None):
        self.sent, self.aborted, self.on_broadcast = 0, threading.Event(), on_broadcast

    def broadcast(self, t, root):
        self.sent += 1
        return self

    def wait(self, timeout=None):
        if self.on_broadcast is not None:
            self.on_broadcast()
        return True

    def is_completed(self):
        return True

    def get_future(self):
        import torch

        done = torch.futures.Future()
        done.set_result(None)
        return done

    def abort(self):
        self.aborted.set()


def test_closing_a_generator_aborts_its_group_and_drops_it_from_the_broadcasts():
    """A generator that drains or leaves: its group is aborted (a broadcast stuck on it ends), later buckets skip
    it, and a broadcast that fails because of the close does not mark it as a failed nccl peer."""
    import torch

    from weights import nccl as C

    peers = C.NcclSender(SimpleNamespace(hub=SimpleNamespace(host="127.0.0.1"),
                                         weights=SimpleNamespace(collective_timeout_s=5.0)), None, "run")

    def add(gen_id, group):
        peer = C.Peer(gen_id, None, 2, -1)
        peer.group, peer.ready = group, True
        peers.peers[gen_id] = peer
        return peer

    def failing():
        raise RuntimeError("connection reset")

    ga, gb = FakeGroup(), FakeGroup()
    a, b = add("a", ga), add("b", gb)
    bucket = torch.zeros(4)
    peers.broadcast(peers.ready(), bucket)
    assert (ga.sent, gb.sent) == (1, 1)
    snapshot = peers.ready()  # what a publish in progress holds
    peers.close("a")
    assert ga.aborted.wait(5) and peers.ready() == [b] and a.group is None  # let go: not the learner's to destroy
    peers.broadcast(snapshot, bucket)
    assert (ga.sent, gb.sent) == (1, 2)  # the closed one is skipped from the next bucket on
    gc, gd = FakeGroup(on_broadcast=lambda: (peers.close("c"), failing())), FakeGroup(on_broadcast=failing)
    add("c", gc)  # closed while it sends
    add("d", gd)  # a real failure
    peers.broadcast(peers.ready(), bucket)
    assert gb.sent == 3 and gc.aborted.wait(5) and gd.aborted.wait(5)
    assert peers.failed == {"d"} and peers.ready() == [b]  # auto gives "d" a file transport next time; not "c"
    again = add("a", FakeGroup())  # "a" registered again: its old group failing late leaves the new one alone
    peers._fail(a, "did not join its process group")
    assert peers.ready() == [b, again] and not again.group.aborted.is_set()


def test_a_version_begun_while_a_generator_joins_reaches_it_too():
    """The joiner gets the newest version by broadcast, then every new one: a publish that begins while the joiner's
    first version is sent waits for it and includes the joiner, instead of missing it for one version."""
    import torch

    from weights import nccl as C

    announced = []
    hub = SimpleNamespace(announce=lambda ready, blob, to=None: announced.append((ready.version, to)))
    sender = C.NcclSender(SimpleNamespace(hub=SimpleNamespace(host="127.0.0.1"),
                                          weights=SimpleNamespace(collective_timeout_s=5.0)), hub, "run")
    store = SimpleNamespace(keys={}, set=lambda k, v: store.keys.__setitem__(k, v))
    peer = C.Peer("j", store, 2, -1)
    peer.group = FakeGroup()
    sender.peers["j"] = peer
    named = [("w", torch.ones(4))]
    sending, release = threading.Event(), threading.Event()

    def latest(fn):  # the publisher's newest CPU copy, v1; held until the test lets it go
        sending.set()
        assert release.wait(5)
        fn(1, named)

    sender.latest = latest
    joiner = threading.Thread(target=sender._admit, args=(peer,))
    joiner.start()
    assert sending.wait(5)
    began = []
    publish = threading.Thread(target=lambda: began.append(sender.begin(2, manifest(named), 0.0)))
    publish.start()
    publish.join(0.3)
    assert publish.is_alive() and not peer.ready  # v2 waits while the joiner gets v1
    release.set()
    joiner.join(5)
    publish.join(5)
    assert began == [True] and sender._sending == [peer]  # v2 goes to the joiner too
    assert announced == [(1, ["j"]), (2, ["j"])] and store.keys == {"weights/0": "1", "weights/1": "2"}
    sender.bucket(torch.zeros(8, dtype=torch.uint8))  # v2's only bucket
    sender.end()  # the lock is free again
    assert peer.group.sent == 2 and sender.join_lock.acquire(timeout=1)


def _rendezvous_threads() -> int:
    return sum(t.name.startswith("rendezvous-") for t in threading.enumerate())


def _nccl_sender(timeout_s: float = 60.0):
    from weights import nccl as C

    hub = SimpleNamespace(run_id="run", announce=lambda *a, **k: None)
    return C.NcclSender(SimpleNamespace(hub=SimpleNamespace(host="127.0.0.1"),
                                        weights=SimpleNamespace(collective_timeout_s=timeout_s)), hub, "run")


def test_registrations_that_leave_without_joining_leave_no_thread_and_no_store_behind():
    """Register/leave churn (nccl): each registration opens a store and a rendezvous thread that waited the whole
    collective timeout, after the generator left too (100 cycles: 100 threads, +1,313 file descriptors). Now
    what a registration holds is freed when it ends."""
    import gc
    import time

    sender = _nccl_sender()
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(40):
        gen = f"churn-{i % 2}"
        sender.open(gen, 2)
        assert _rendezvous_threads() <= 10  # generous: the previous ones are stopping
        sender.leave(gen)
    deadline = time.monotonic() + 10
    while _rendezvous_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    assert _rendezvous_threads() == 0 and not sender.peers
    assert len(os.listdir("/proc/self/fd")) <= fds + 4  # no store left open
    assert sender.failed == set()  # left, not failed: it may use nccl next time


def _joined(sender, timeout_s: float):
    """Generator "g", one worker in this process, joins its group with `sender`; returns the worker."""
    import time

    from generator.worker_ext import WeightLoader

    worker = WeightLoader()
    setup = sender.open("g", 2)
    joined = threading.Thread(target=worker.init_collective,
                              args=("127.0.0.1", setup["port"], 2, "gloo", timeout_s))
    joined.start()
    joined.join(20)
    deadline = time.monotonic() + 10
    while not sender.is_ready("g") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sender.is_ready("g")
    return worker


def test_a_generator_that_comes_joins_its_group_and_is_sent_versions():
    """The rendezvous waits for the workers (they add themselves to JOIN_KEY), then makes the group."""
    sender = _nccl_sender(10.0)
    worker = _joined(sender, 10.0)
    got = torch.zeros(4)
    receive = threading.Thread(target=lambda: worker._collective.broadcast(got, 0).wait())
    receive.start()
    sender.broadcast(sender.ready(), torch.arange(4, dtype=torch.float32))
    receive.join(10)
    assert torch.equal(got, torch.arange(4, dtype=torch.float32)) and sender.failed == set()
    sender.leave("g")


def test_a_broadcast_to_a_generator_that_stopped_receiving_ends_when_it_is_dropped():
    """A generator whose host vanished (a cut link: no FIN, no RST) stops receiving in the middle of a version. Gloo's
    send to it waits for the group's timeout, and neither its abort nor a close ends that wait: the learner stood
    still weights.collective_timeout_s after the hub had dropped the generator. Now the broadcast ends when the hub
    drops it, and letting the peer go (the publisher's list of the last version's peers) does not join the group's
    threads on the learner's thread, which waited that long too."""
    import gc
    import time

    sender = _nccl_sender(20.0)
    worker = _joined(sender, 20.0)  # its end in this process: it joins, then receives nothing (held to the end: a
    # worker let go closes its group, and the broadcast would fail instead)
    sending = sender.ready()  # what a publish in progress holds
    assert sending
    threading.Timer(1.0, sender.leave, args=("g",)).start()  # the hub drops it: silent for hub.heartbeat_timeout_s
    start = time.monotonic()
    sender.broadcast(sending, torch.zeros(64 * 2**20, dtype=torch.uint8))  # more than the sockets hold
    assert time.monotonic() - start < 5  # not the group's 20 s
    assert sender.failed == set() and not sender.ready()  # dropped, not failed: it may use nccl next time
    time.sleep(1)  # a step later
    start = time.monotonic()
    del sending  # the next version's peers replace these
    gc.collect()
    assert time.monotonic() - start < 5
    del worker
