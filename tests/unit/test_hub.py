"""The hub over real ZeroMQ sockets, in process (no engines): admission, staleness, bad input, liveness."""

import json
import threading
import time

import msgpack
import numpy as np
import pytest

from hub.hub import Hub, HubStopped
from pipeline import protocol as P
from pipeline.config import config_from_dict
from pipeline.status import render
from pipeline.tasks import echo_rows
from tests.unit.peers import VOCAB, Peer, encode, new_hub, publish, wait_until
from weights.nccl import NcclSender
from weights.nccl import Peer as NcclPeer


@pytest.fixture
def make_hub(tmp_path):
    hubs = []

    def make(**trainer):
        hub = new_hub(tmp_path, trainer=trainer)
        hubs.append(hub)
        return hub

    yield make
    for h in hubs:
        h.stop()


def _wait_buffer(hub, n, timeout=5):
    deadline = time.monotonic() + timeout
    while len(hub.ledger.buffer) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(hub.ledger.buffer) >= n


def test_a_leave_that_overtakes_the_last_rollouts_waits_for_them(make_hub, monkeypatch):
    """A draining generator sends its last rollouts (rollouts socket) and then Leave (control socket): Leave can
    arrive first. It says how many rollouts it sent, and the hub drops it once they are in: the drained group is
    trained, not rejected as a stranger's. Rollouts that never come are waited for LEAVE_GRACE_S."""
    from hub import membership

    hub = make_hub(max_staleness=1)
    peer, late = Peer(hub, "gen-a"), Peer(hub, "gen-b")
    assert isinstance(peer.register(), P.Welcome) and isinstance(late.register(), P.Welcome)
    lease = peer.lease(1)
    assert peer.ask(P.Leave("gen-a", pushed=1)) == P.Ack()  # its one rollout is still on its way
    assert "gen-a" in hub.registry.generators
    peer.send_groups(lease)
    wait_until(lambda: "gen-a" not in hub.registry.generators)
    assert hub.counters["rollouts"] == 1 and len(hub.ledger.buffer) == 1  # trained, not rejected
    assert not any(hub.counters[k] for k in hub.counters if k.startswith("rejected"))

    monkeypatch.setattr(membership, "LEAVE_GRACE_S", 0.2)
    other = late.lease(1)
    assert late.ask(P.Leave("gen-b", pushed=1)) == P.Ack()  # a rollout it says it sent, which never comes
    time.sleep(0.3)
    hub.tick()
    assert "gen-b" not in hub.registry.generators and list(other.groups)[0] is not None
    assert len(hub.ledger.pending) > 0 and not hub.ledger.leases  # its lease went back to the queue
    peer.close()
    late.close()


def test_a_wait_for_room_is_longer_with_many_generators_so_they_do_not_flood_the_hub(make_hub):
    """Told to wait for room in the window, a generator asks again after Wait.retry_s: 50 ms, and with many
    generators long enough that together they ask at most about 1,000 times a second."""
    hub = make_hub(max_staleness=0)
    peers = [Peer(hub, f"gen-{i}") for i in range(3)]
    assert all(isinstance(p.register(), P.Welcome) for p in peers)
    replies = [p.lease(8) for p in peers for _ in range(2)]  # until the window (one batch of 2) is full
    assert sum(len(r.groups) for r in replies if isinstance(r, P.Lease)) == 2
    assert replies[-1] == P.Wait("staleness window full", 0.05)
    for i in range(2000):  # as if 2,000 more had registered
        hub.registry.generators[f"many-{i}"] = hub.registry.generators["gen-2"]
    assert hub.desk.retry_s() == pytest.approx(2.003)
    assert peers[2].lease(8) == P.Wait("staleness window full", pytest.approx(2.003))
    for p in peers:
        p.close()


def test_admission_with_k0_is_one_batch_at_a_time(make_hub):
    hub = make_hub(max_staleness=0)
    peer = Peer(hub)
    assert isinstance(peer.register(), P.Welcome)
    lease = peer.lease(8)
    assert isinstance(lease, P.Lease) and len(lease.groups) == 2 and lease.min_version == 0
    assert peer.lease(8) == P.Wait("staleness window full", 0.05)
    peer.send_groups(lease)
    _wait_buffer(hub, 2)
    batch, *_ = hub.take_batch(0)
    assert len(batch) == 2
    assert isinstance(peer.lease(8), P.Wait)  # the groups in the step still count until it publishes
    publish(hub, 1)
    nxt = peer.lease(8)
    assert len(nxt.groups) == 2 and nxt.min_version == 1  # k = 0: generate on the new weights only
    peer.close()


def test_admission_with_k3_lets_generation_run_ahead(make_hub):
    hub = make_hub(max_staleness=3)
    peer = Peer(hub)
    peer.register()
    leases = [peer.lease(2) for _ in range(5)]
    granted = [x for x in leases if isinstance(x, P.Lease)]
    assert sum(len(x.groups) for x in granted) == 8  # (k + 1) * batch_size
    assert [x.min_version for x in granted] == [0, 0, 0, 0]
    assert isinstance(leases[-1], P.Wait)
    peer.close()


def test_stale_groups_are_dropped_and_requeued(make_hub):
    hub = make_hub(max_staleness=1)
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(2)
    peer.send_groups(lease, version=0)
    _wait_buffer(hub, 2)
    hub.version = 2  # as if two steps had passed: version-0 samples are 2 > k behind step 2
    pending_before = len(hub.ledger.pending)
    result = {}

    def learner():
        try:
            result["batch"] = hub.take_batch(2)
        except HubStopped:
            result["stopped"] = True

    t = threading.Thread(target=learner)
    t.start()
    wait_until(lambda: hub.counters.get("stale_dropped") == 2)
    assert len(hub.ledger.buffer) == 0
    assert len(hub.ledger.pending) == pending_before + 2
    assert hub.ledger.pending[0] == (lease.groups[0].epoch, lease.groups[0].prompt_id)  # re-queued at the front
    hub.stop()  # the waiting learner is released with HubStopped, not left hanging
    t.join(2)
    assert result == {"stopped": True}
    peer.close()


def test_bad_input_gets_clear_errors_and_the_hub_keeps_serving(make_hub):
    other = P.SCHEMA_VERSION + 1  # another release's
    hub = make_hub()
    peer = Peer(hub)
    cases = [
        (np.random.default_rng(0).bytes(64), "not a valid MessagePack"),
        (P.encode(P.Register("x"))[:-4], "not a valid MessagePack"),
        (msgpack.packb({"v": other, "k": "register", "generator_id": "x"}), f"schema version {other}"),
        (P.encode(P.Register("x", host="h" * (3 * 2**19))), "exceeds the limit"),
        (P.encode(P.Lease(1, 0, [], P.Sampling(8, 1.0))), "unexpected message Lease"),
        (P.encode(P.Heartbeat("never-registered")), "unknown generator id"),
    ]
    for data, message in cases:
        reply = peer.raw(data)
        assert isinstance(reply, P.Error) and message in reply.message, reply
        assert reply.stop == (message == f"schema version {other}")  # another release: the peer leaves, no retries
    # rollouts: garbage, a wrong kind, and a group for a lease that does not exist are logged and counted
    peer.register()
    peer.push.send(b"\x00garbage")
    peer.push.send(P.encode(P.Heartbeat("gen-t")))
    peer.send_groups(P.Lease(999, 0, [P.PromptItem(0, 0, "p")], P.Sampling(8, 1.0)))
    deadline = time.monotonic() + 5
    while hub.counters["unknown_lease"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hub.counters["unknown_lease"] == 1 and hub.counters["bad_messages"] == 5
    assert hub.counters["rejected/malformed"] == 2
    assert isinstance(peer.lease(1), P.Lease)  # still serving
    assert not hub.ledger.buffer
    peer.close()


def test_hub_answers_while_a_training_step_runs(make_hub):
    hub = make_hub()
    peer = Peer(hub)
    peer.register()
    step_running = threading.Event()
    step_done = threading.Event()

    answers_done = threading.Event()

    def busy_step():  # a learner step holding the GIL in Python code until the hub has answered (60 s at most)
        step_running.set()
        end = time.monotonic() + 60.0
        x = 0
        while time.monotonic() < end and not answers_done.is_set():
            x += 1
        step_done.set()

    t = threading.Thread(target=busy_step)
    t.start()
    step_running.wait()
    answered = 0
    while not step_done.is_set() and answered < 20:
        assert isinstance(peer.ask(P.Heartbeat("gen-t", 0)), P.HeartbeatReply)  # (it holds no lease: none is expired)
        assert isinstance(peer.lease(1), (P.Lease, P.Wait))
        answered += 1
    assert answered == 20 and not step_done.is_set(), "the hub must answer during the step, not after it"
    answers_done.set()
    t.join()
    peer.close()


def test_silent_generator_is_dropped_and_its_leases_requeued(make_hub):
    hub = make_hub()
    hub.cfg.hub.heartbeat_timeout_s = 0.5
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(2)
    assert len(lease.groups) == 2
    deadline = time.monotonic() + 5
    while hub.registry.generators and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not hub.registry.generators and not hub.ledger.leases and hub.counters["requeued"] == 2
    assert list(hub.ledger.pending)[:2] == [(g.epoch, g.prompt_id) for g in lease.groups]
    reply = peer.lease(1)  # a late request from the dropped generator: told to register again
    assert isinstance(reply, P.Error) and reply.fatal
    peer.send_groups(lease)  # its late rollouts are recognised and dropped: it is no longer registered
    wait_until(lambda: hub.counters.get("rejected/generator") == 2)
    assert not hub.ledger.buffer
    peer.close()


def test_run_time_changes(make_hub, tmp_path):
    hub = make_hub(max_staleness=0)
    peer = Peer(hub)
    ok = peer.ask(P.SetRequest("trainer.max_staleness", 2))  # no auth.keys: anyone on loopback may
    assert isinstance(ok, P.SetReply) and (ok.value, hub.cfg.trainer.max_staleness) == (2, 2)
    assert "trainer.max_staleness" in (tmp_path / "changes.jsonl").read_text()
    refused = peer.ask(P.SetRequest("trainer.batch_size", 4))
    assert isinstance(refused, P.Error) and "cannot change while a run goes on" in refused.message
    unknown = peer.ask(P.SetRequest("trainer.nope", 4))
    assert isinstance(unknown, P.Error) and "unknown field" in unknown.message
    status = peer.ask(P.StatusRequest())
    assert status.max_staleness == 2
    peer.close()


def test_heartbeat_names_dead_leases_and_reregistration_voids_old_ones(make_hub):
    hub = make_hub()
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(2)
    ack = peer.ask(P.Heartbeat("gen-t", 0, lease_ids=[lease.lease_id, 12345]))
    assert ack.dead_leases == [12345]  # the generator drops work for leases the hub no longer has
    peer.register()  # the same id again, with its session (a reconnect): old leases void, prompts re-queued
    assert lease.lease_id not in hub.ledger.leases and hub.counters["requeued"] == 2
    ack = peer.ask(P.Heartbeat("gen-t", 0, lease_ids=[lease.lease_id]))
    assert ack.dead_leases == [lease.lease_id]
    peer.send_groups(lease)  # late rollouts of the void lease are recognised and dropped
    deadline = time.monotonic() + 5
    while hub.counters["unknown_lease"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hub.counters["unknown_lease"] == 2 and not hub.ledger.buffer
    peer.close()


class FakeNccl(NcclSender):
    """weights.nccl.NcclSender as the hub drives it, without process groups."""

    def __init__(self, hub):
        self.announcer, self.run_id = hub, hub.run_id
        self.lock, self.peers, self.failed, self.transports = threading.Lock(), {}, set(), {"nccl"}
        self.opened, self.closed, self.letting_go = [], [], []

    def open(self, generator_id, world, loaded_version=-1):
        self.opened.append((generator_id, world, loaded_version))
        self.peers[generator_id] = NcclPeer(generator_id, None, world, loaded_version)
        return {"port": 1, "world_size": world, "backend": "gloo", "timeout_s": 1.0}

    def close(self, generator_id):
        self.closed.append(generator_id)
        self.peers.pop(generator_id, None)


def test_auto_transport_picks_nccl_for_other_gpus_and_a_file_otherwise(make_hub, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    hub = make_hub()
    nccl = hub.weights.senders["nccl"] = FakeNccl(hub)
    file_joins = []
    files = hub.weights.senders["shm"]
    files.latest = lambda fn, background=False: file_joins.append(hub.version)
    peer = Peer(hub)
    here = hub.weights._host

    sessions = {}

    def register(gen_id, gpus, boot=here, loaded=-1):
        peer.id = gen_id
        w = peer.ask(P.Register(gen_id, "h", boot, gpus, 1, loaded, tensor_parallel=2, session=sessions.get(gen_id, ""),
                                loaded_run="test", spec_digest=hub.membership.spec_digest))
        sessions[gen_id] = w.session
        return w

    assert files.wanted()  # nobody registered yet: the next one may need a file
    w = register("a", "1", loaded=0)
    assert w.transport == "nccl" and w.collective.world_size == 3
    assert nccl.opened == [("a", 3, 0)]
    assert not files.wanted()  # only nccl generators: no blob per version
    assert register("b", "0").transport == "shm"  # the learner's GPU: colocated, shared memory
    assert register("c", "").transport == "shm"  # no GPUs reported (a CPU engine)
    assert register("d", "0", boot="elsewhere").transport == "nccl"  # GPU 0 of another host
    assert register("e", "", boot="elsewhere").transport == "zmq"
    assert files.wanted()
    nccl.failed.add("f")
    assert register("f", "2").transport == "shm"  # its group failed once
    assert register("a", "1").transport == "shm"  # re-registers without ever joining: it gave up on nccl
    assert "a" in nccl.failed
    nccl.peers["d"].ready = True
    assert register("d", "0", boot="elsewhere").transport == "nccl"  # a joined one keeps nccl
    # a file joiner while the newest version has no blob (none yet, or broadcast only) asks for one
    assert file_joins == [0] * 5  # b, c, e, f and a's second registration
    hub.finish_step(3)
    register("g", "")
    assert file_joins == [0] * 5 + [3]
    peer.close()


def test_explicit_transport_is_kept(make_hub):
    hub = make_hub()
    hub.cfg.weights.transport = "zmq"
    hub.weights.senders["nccl"] = FakeNccl(hub)
    peer = Peer(hub)
    digest = hub.membership.spec_digest
    assert peer.ask(P.Register("x", "h", hub.weights._host, "1", spec_digest=digest)).transport == "zmq"
    peer.close()


def test_a_hub_started_without_the_learners_weight_senders_says_so_at_once(tmp_path):
    """The senders are the learner's (Hub.serve_weights): without them every generator would be refused at
    registration, so the hub refuses to start, naming what is missing."""
    hub = Hub(config_from_dict({}), echo_rows(4, 0), tmp_path, "test", encode=encode, vocab_size=VOCAB)
    with pytest.raises(RuntimeError, match="no weight senders.*serve_weights"):
        hub.start()
    hub.stop()


def test_a_draining_generator_gets_no_more_broadcasts_but_keeps_its_leases(make_hub, tmp_path):
    hub = make_hub()
    hub.weights.senders["nccl"] = FakeNccl(hub)
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(2)
    assert peer.ask(P.Heartbeat(peer.id, 0, 0.0, 2, [lease.lease_id])).dead_leases == []
    assert hub.weights.senders["nccl"].closed == []
    for _ in range(2):  # reported once, acted on once
        assert isinstance(peer.ask(P.Heartbeat(peer.id, 0, 0.0, 2, [lease.lease_id], draining=True)), P.HeartbeatReply)
    assert hub.weights.senders["nccl"].closed == [peer.id]  # its process group: out of the next broadcasts, aborted
    assert hub.status().generators[0].draining is True
    assert render(hub.status()).splitlines()[-1].endswith("draining")  # `pipeline status` shows it
    peer.send_groups(lease)  # the groups it finishes while draining still count
    _wait_buffer(hub, 2)
    assert isinstance(peer.ask(P.Leave(peer.id)), P.Ack)
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events.count("drain") == 1 and events.index("drain") < events.index("leave")
    peer.close()


def test_dynamic_sampling_filters_groups_without_signal_as_they_arrive(make_hub):
    """trainer.dynamic_sampling: a group whose rewards are all equal is not buffered (done for its epoch, counted),
    so the batch fills with fresh groups; without it, the group is buffered like any other."""
    for dynamic in (True, False):
        hub = make_hub(dynamic_sampling=dynamic)
        peer = Peer(hub)
        peer.register()
        lease = peer.lease(3)
        same = {"reward": 1.0, "rewards": [1.0]}
        peer.send(peer.group(lease, lease.groups[0], sample=same))
        for item in lease.groups[1:]:
            peer.send(peer.group(lease, item))
        _wait_buffer(hub, 2 if dynamic else 3)
        time.sleep(0.1)
        assert len(hub.ledger.buffer) == (2 if dynamic else 3)
        assert hub.counters.get("filtered_groups", 0) == (1 if dynamic else 0)
        assert hub.ledger.done((lease.groups[0].epoch, lease.groups[0].prompt_id)) == dynamic
        peer.close()


def test_auto_transport_picks_ipc_for_a_generator_on_the_learners_own_gpu(make_hub, monkeypatch):
    from weights.ipc import IpcSender

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    hub = make_hub()
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    ipc = hub.weights.senders["ipc"] = IpcSender(hub.weights.cfg, hub, "run")
    hub.weights.senders["nccl"] = FakeNccl(hub)
    peer = Peer(hub)
    here = hub.weights._host

    def register(gen_id, gpus, boot=here, tp=1):
        peer.id = gen_id
        return peer.ask(P.Register(gen_id, "h", boot, gpus, 1, -1, tensor_parallel=tp, loaded_run="test",
                                   spec_digest=hub.membership.spec_digest)).transport

    assert register("a", "3") == "ipc"  # rank 0's GPU (the first visible one), same host
    assert "a" in ipc.applied
    assert register("b", "4") == "nccl"  # learner rank 1's GPU: rank 0 broadcasts from GPU 3
    assert register("d", "3", boot="elsewhere") == "nccl"  # GPU 3 of another host
    assert register("e", "3,5", tp=2) == "shm"  # tensor parallel: its second worker is on another GPU
    ipc.failed.add("f")
    assert register("f", "3") == "shm"
    hub.weights.applied("a", 0)  # WeightsApplied reaches the sender
    assert ipc.applied["a"] == 0
    peer.id = "a"
    assert isinstance(peer.ask(P.Heartbeat("a", 0)), P.HeartbeatReply)
    hub.drop("a", "ipc transport: did not apply weights v1 within 120 s")  # what the sender does to a late one
    reply = peer.ask(P.Heartbeat("a", 0))
    assert isinstance(reply, P.Error) and reply.fatal and "register again" in reply.message
    assert "a" not in ipc.applied
    peer.close()


def test_the_generators_on_the_learners_gpus_are_counted_for_the_verdict(make_hub, monkeypatch):
    """A step's record says how many generators share a GPU with a learner rank (any of CUDA_VISIBLE_DEVICES, not only
    rank 0's), for the verdict to name them: on one machine, by GPU number; not a generator of another host."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")  # two learner ranks
    hub = make_hub()
    peer = Peer(hub)
    here = hub.weights._host

    def register(gen_id, gpus, boot=here):
        peer.id = gen_id
        return peer.ask(P.Register(gen_id, "h", boot, gpus, 1, -1, loaded_run="test",
                                   spec_digest=hub.membership.spec_digest))

    assert hub.step_stats().on_learner_gpus == 0
    register("a", "3")  # rank 0's GPU
    register("b", "4")  # rank 1's
    register("c", "5")  # a GPU of its own
    register("d", "3", boot="elsewhere")  # GPU 3 of another machine
    register("e", "")  # a CPU engine
    stats = hub.step_stats()
    assert (stats.generators, stats.on_learner_gpus) == (5, 2)
    hub.drop("b", "test")
    assert hub.step_stats().on_learner_gpus == 1
    peer.close()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # unset: GPU 0 for a learner on a GPU, none for one on the CPU
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    on_gpu_0 = P.Register("f", "h", here, "0", 1, -1)
    assert not hub.weights.on_learner_gpus(on_gpu_0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert hub.weights.on_learner_gpus(on_gpu_0)


def test_every_group_of_a_lease_started_at_its_min_version_is_within_k_when_trained(tmp_path):
    """Leases of 3 groups with batches of 4 straddle batch boundaries. A generator that starts each lease's groups
    on the oldest weights the lease allows (its min_version) loses none of them to the stale filter, and every
    trained group lags at most k: min_version holds for the lease's last group, not only its first."""
    k, B = 1, 4
    hub = new_hub(tmp_path, version=5, trainer={"max_staleness": k, "batch_size": B, "total_steps": 12},
                  generator={"lease_size": 3})
    peer = Peer(hub)
    peer.register()
    sent = 0
    try:
        for step in range(5, 12):
            while isinstance(lease := peer.lease(3), P.Lease):
                peer.send_groups(lease, version=lease.min_version)
                sent += len(lease.groups)
            wait_until(lambda n=sent: hub.counters["rollouts"] >= n)
            batch, _, knobs = hub.take_batch(step)
            assert knobs["trainer.max_staleness"] == k
            assert all(step - min(s.first_version for s in g.samples) <= k for g in batch)
            publish(hub, step + 1)
        assert sent >= 7 * B and hub.counters["stale_dropped"] == 0
    finally:
        peer.close()
        hub.stop()


def test_a_staleness_change_holds_from_the_step_its_reply_names(make_hub):
    """`pipeline set trainer.max_staleness=0` while step 0 trains: its batch keeps the bound it was built under (and
    says so), the reply names step 1, and step 1's batch is built under k = 0: a group older than that is not
    trained but dropped as stale."""
    hub = make_hub(max_staleness=2)
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(2)
    peer.send_groups(lease, version=0)
    _wait_buffer(hub, 2)
    batch, _, knobs = hub.take_batch(0)
    assert knobs["trainer.max_staleness"] == 2
    old = peer.lease(2)  # generated at version 0, trained no earlier than step 1
    peer.send_groups(old, version=0)
    _wait_buffer(hub, 2)
    reply = peer.ask(P.SetRequest("trainer.max_staleness", 0))
    assert isinstance(reply, P.SetReply) and reply.from_step == 1  # step 0's batch was taken under k = 2
    publish(hub, 1)
    result = {}
    learner = threading.Thread(target=lambda: result.update(taken=hub.take_batch(1)))
    learner.start()
    wait_until(lambda: hub.counters.get("stale_dropped") == 2)  # the version-0 groups lag 1 > 0 at step 1
    fresh = peer.lease(2)
    assert fresh.min_version == 1
    peer.send_groups(fresh, version=1)
    learner.join(5)
    batch, _, knobs = result["taken"]
    assert knobs["trainer.max_staleness"] == 0
    assert [g.samples[0].first_version for g in batch] == [1, 1]
    peer.close()


def test_a_heartbeat_reports_its_stages_and_one_that_lies_is_refused_naming_the_field(make_hub):
    """Heartbeat.stage_s (seconds per generator stage, pipeline/trace.py) is kept for the learner's record; a name
    outside protocol.STAGES, or seconds that are negative or not finite, are refused, counted, and named."""
    hub = make_hub()
    peer = Peer(hub)
    peer.register()
    assert isinstance(peer.ask(P.Heartbeat("gen-t", 0, stage_s={"generating": 1.5, "score": 0.25})), P.HeartbeatReply)
    assert hub.step_stats().stages == {"gen-t": {"generating": 1.5, "score": 0.25}}
    for stages, named in (({"mining": 1.0}, "'mining' is not one of"), ({"score": -1.0}, "stage_s['score']: -1.0"),
                          ({"send": float("nan")}, "stage_s['send']: nan"), ({"idle": "1"}, "stage_s['idle']: '1'")):
        refused = hub.counters["refused"]
        reply = peer.ask(P.Heartbeat("gen-t", 0, stage_s=stages))
        assert isinstance(reply, P.Error) and named in reply.message, reply
        assert hub.counters["refused"] == refused + 1
    assert hub.step_stats().stages == {"gen-t": {"generating": 1.5, "score": 0.25}}  # the last true report stays
    peer.close()


def test_a_group_stopped_as_stale_is_leased_again_once_its_lease_shows_it_could_be(make_hub):
    """GroupFailed kind "stale": a generator stopped a group that no step can train any more. The claim is checked
    against the lease (its groups start at its min_version or later): within k of the hub's version it is refused,
    naming why, and the lease keeps the prompt; past it, the prompt goes to the front of the queue, the window's room
    comes back, and it counts as stale, not against the generator."""
    hub = make_hub(max_staleness=1)
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(2)
    item = lease.groups[0]
    stale = P.GroupFailed(peer.id, lease.lease_id, item.epoch, item.prompt_id, reason="x", kind="stale")
    hub.finish_step(1)
    refused = peer.ask(stale)
    assert isinstance(refused, P.Error) and "can still be trained" in refused.message
    assert hub.counters["refused"] == 1  # counted
    assert (item.epoch, item.prompt_id) in hub.ledger.leases[lease.lease_id].items
    hub.finish_step(2)
    in_flight = hub.ledger.in_flight()
    assert isinstance(peer.ask(stale), P.Ack)
    with hub.lock:
        assert hub.ledger.in_flight() == in_flight - 1 and hub.ledger.pending[0] == (item.epoch, item.prompt_id)
        assert hub.counters["stale_stopped"] == 1 and not hub.ledger.attempts
    peer.close()

