"""The hub against broken and hostile peers, over real sockets: nothing invalid enters the buffer, no peer
speaks for another, no single peer ends the run, and what ends it says why."""

from __future__ import annotations

import json
import math
import time

import pytest
import zmq

from hub.hub import DatasetExhausted, HubStopped
from pipeline import protocol as P
from pipeline.status import render
from pipeline.tasks import echo_rows
from tests.unit.peers import Peer, new_hub, wait_until


@pytest.fixture
def hubs(tmp_path):
    made = []

    def make(rows=None, **sections):
        hub = new_hub(tmp_path, rows, **sections)
        made.append(hub)
        return hub

    yield make
    for h in made:
        h.stop()


def _sample(**fields):
    return {"sample": fields}


# (case, what the peer changes in an otherwise valid group, the rejection reason)
INVALID = [
    ("token id = vocab size", dict(tokens=(4, 16)), "token_id"),
    ("negative token id", dict(tokens=(-1, 5)), "token_id"),
    ("NaN reward", _sample(reward=math.nan), "reward"),
    ("infinite reward", _sample(reward=math.inf), "reward"),
    ("infinite per-function reward", _sample(rewards=[-math.inf]), "reward"),
    ("NaN log-prob", dict(logprobs=(math.nan, -1.0)), "logprob"),
    ("positive log-prob", dict(logprobs=(-1.0, 0.5)), "logprob"),
    ("longer than sampling.max_tokens", dict(tokens=(4,) * 9, logprobs=(-1.0,) * 9), "length"),
    ("prompt + completion past max_model_len", dict(tokens=(4,) * 8, logprobs=(-1.0,) * 8), "length"),
    ("a future version", dict(version=1), "version"),
    ("a negative version", dict(version=-1), "version"),
    ("another temperature", dict(temperature=0.5), "temperature"),
    ("temperature 0", dict(temperature=0.0), "temperature"),
    ("too many samples", dict(group_size=3), "samples"),
    ("another prompt", dict(prompt_ids=P.pack_ints([4, 4, 4])), "prompt"),
    ("token ids and log-probs of two lengths", dict(logprobs=(-1.0,)), "structure"),
    # an agent's samples (generator/agent.py): their own contexts, turns and trajectories are checked too
    ("an own context outside the vocabulary", _sample(prompt_ids=P.pack_ints([4, 16])), "token_id"),
    ("an own context past max_model_len", _sample(prompt_ids=P.pack_ints([4] * 11)), "length"),
    ("a turn past its sample's tokens", _sample(turns=P.pack_ints([2, 0])), "version"),
    ("a turn of a version its sample was not sampled at", _sample(turns=P.pack_ints([0, 1])), "version"),
    ("every sample claiming trajectory 0", _sample(trajectory=0), "samples"),
    ("a split trajectory with two rewards", dict(samples=[
        P.Sample(P.pack_ints((4, 5)), P.pack_floats((-1.0, -1.0)), float(r), [float(r)], "stop", trajectory=t,
                 prompt_ids=P.pack_ints([4, 4]) if k == 2 else b"")
        for k, (t, r) in enumerate([(0, 0), (1, 1), (1, 0)])]),
     "reward"),
]


@pytest.mark.parametrize("case, change, reason", INVALID, ids=[c[0] for c in INVALID])
def test_an_invalid_rollout_is_rejected_by_reason_and_its_prompt_leased_again(hubs, case, change, reason):
    hub = hubs(generator={"max_model_len": 12})  # echo prompts are 5 tokens: 7 completion tokens fit
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(1)
    item = lease.groups[0]
    key = (item.epoch, item.prompt_id)
    peer.send(peer.group(lease, item, **change))
    wait_until(lambda: hub.counters.get(f"rejected/{reason}", 0) == 1)
    assert not hub.ledger.buffer and hub.counters["rejected_rollouts"] == 1
    assert hub.ledger.pending[0] == key and not hub.ledger.leases  # off the lease, first in line to be leased again
    again = peer.lease(1)
    assert [(g.epoch, g.prompt_id) for g in again.groups] == [key]
    peer.send(peer.group(again, again.groups[0]))  # the same prompt, generated correctly this time
    wait_until(lambda: len(hub.ledger.buffer) == 1)
    assert render(hub.status()).count(f"{reason} 1") == 1  # `pipeline status` names the reason
    peer.close()


def test_an_agents_split_trajectory_with_its_turns_is_accepted(hubs):
    """Three samples of two trajectories: the second split, with the context it was sampled from; turns in range."""
    hub = hubs(generator={"max_model_len": 12})
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(1)
    samples = [P.Sample(P.pack_ints((4, 5)), P.pack_floats((-1.0, -1.0)), float(r), [float(r)], "stop", trajectory=t,
                        prompt_ids=P.pack_ints([4, 4, 5]) if k == 2 else b"", turns=P.pack_ints([0, 0, 1, 0]))
               for k, (t, r) in enumerate([(0, 0), (1, 1), (1, 1)])]
    peer.send(peer.group(lease, lease.groups[0], samples=samples))
    wait_until(lambda: len(hub.ledger.buffer) == 1)
    assert hub.counters["rejected_rollouts"] == 0
    peer.close()


def test_the_whole_group_check_passes_only_groups_every_sample_check_passes():
    """The hub checks a group with a few array operations (`_clean`) and asks each sample only when that fails: it
    must never pass a group a sample's check refuses. Random groups, each with one value changed or none."""
    import random

    import numpy as np

    from hub.validation import Expected, Rejected, RunShape, _check_sample, _clean, check_rollout

    rng = random.Random(0)
    shape = RunShape(vocab_size=16, group_size=4, max_tokens=8, max_model_len=12, rewards=1)
    prompt = P.pack_ints([4, 5, 6])
    odd = [math.nan, math.inf, -math.inf, 0.5, 1e-30, -0.0, 0.0, -1e30]
    passed = refused = 0
    for _ in range(3000):
        samples = []
        for _ in range(4):
            n = rng.randrange(0, 10)
            tokens = [rng.randrange(0, 16) for _ in range(n)]
            logprobs = [-rng.random() * 5 for _ in range(n)]
            version = [rng.choice([0, 1, 2]) for _ in range(2)]
            samples.append(dict(tokens=tokens, logprobs=logprobs, reward=rng.random(), rewards=[rng.random()],
                                first=min(version), last=max(version), gen_ms=rng.random()))
        s = rng.choice(samples)
        change = rng.randrange(9)
        if change == 0 and s["tokens"]:
            s["tokens"][rng.randrange(len(s["tokens"]))] = rng.choice([-1, 16, 2**31 - 1, -2**31])
        elif change == 1 and s["logprobs"]:
            s["logprobs"][rng.randrange(len(s["logprobs"]))] = rng.choice(odd)
        elif change == 2:
            s["reward"] = rng.choice(odd)
        elif change == 3:
            s["rewards"] = rng.choice([[], [1.0, 2.0], [rng.choice(odd)]])
        elif change == 4:
            s["first"], s["last"] = rng.choice([(-1, 0), (2, 1), (0, 3), (1, 1)])
        elif change == 5:
            s["gen_ms"] = rng.choice(odd)
        group = P.RolloutGroup(lease_id=1, generator_id="g", prompt_id=0, epoch=0, prompt_ids=prompt, samples=[
            P.Sample(P.pack_ints(x["tokens"]), P.pack_floats(x["logprobs"]), x["reward"], x["rewards"], "length",
                     x["first"], x["last"], x["gen_ms"]) for x in samples], temperature=1.0, session="s")
        fails = []
        for i, sample in enumerate(group.samples):
            try:
                _check_sample(sample, f"samples[{i}]", 3, 0, 2, shape)
            except Rejected as e:
                fails.append(e.reason)
        assert _clean(group.samples, 3, 0, 2, shape) == (not fails), (samples, fails)
        try:
            check_rollout(group, Expected(prompt, 1.0, 0), 2, shape)
            passed += 1
        except Rejected as e:
            assert fails and e.reason in (fails[0], "structure")  # first > last: the codec's check, first
            refused += 1
    assert passed > 500 and refused > 500  # both ways, many times
    assert np.float32(-0.0) <= 0  # -0.0 is a log-prob of 1: allowed


def test_rollouts_from_strangers_and_for_other_generators_leases_are_rejected_and_lose_nothing(hubs):
    hub = hubs()
    owner, other = Peer(hub, "owner"), Peer(hub, "other")
    owner.register()
    other.register()
    lease = owner.lease(1)
    item = lease.groups[0]
    stranger = Peer(hub, "never-registered")
    stranger.send(stranger.group(lease, item))
    other.send(other.group(lease, item))  # a registered generator, but the lease is the owner's
    forged = owner.group(lease, item, session="0" * 32)  # the owner's id without its session
    other.send(forged)
    wait_until(lambda: hub.counters["rejected_rollouts"] == 3)
    assert {k: v for k, v in hub.counters.items() if k.startswith("rejected/")} == {
        "rejected/generator": 1, "rejected/lease": 1, "rejected/identity": 1}
    assert not hub.ledger.buffer and list(hub.ledger.leases) == [lease.lease_id]  # still the owner's to deliver
    owner.send(owner.group(lease, item))
    wait_until(lambda: len(hub.ledger.buffer) == 1)
    assert hub.ledger.buffer[0][0].generator_id == "owner"
    for p in (owner, other, stranger):
        p.close()


def test_no_peer_can_speak_for_another_generator(hubs):
    hub = hubs()
    victim = Peer(hub, "victim")
    victim.register()
    lease = victim.lease(2)
    hub.weights.blobs.put(0, b"w" * 100)
    attacker = Peer(hub, "victim")  # another connection using the victim's id
    forged = [P.Heartbeat("victim", 99, draining=True), P.WeightsApplied("victim", 99), P.Leave("victim"),
              P.LeaseRequest("victim", 4), P.GroupFailed("victim", lease.lease_id, lease.groups[0].epoch,
                                                         lease.groups[0].prompt_id, "nope", "prompt"),
              P.WeightsFetch(0, 0, 100, "victim"), P.Register("victim"), P.Register("victim", session="f" * 32)]
    for msg in forged:
        reply = attacker.ask(msg)
        assert isinstance(reply, P.Error) and "connection" in reply.message, (msg, reply)
    gen = hub.registry.generators["victim"]
    assert (gen.version, gen.draining) == (-1, False) and list(hub.ledger.leases) == [lease.lease_id]
    assert hub.counters["refused"] == len(forged) and hub.counters["rejected_prompts"] == 0
    assert isinstance(victim.ask(P.Heartbeat("victim", 0, lease_ids=[lease.lease_id])), P.HeartbeatReply)  # unharmed
    # the victim itself, reconnecting from a new connection with its session, may take its id back
    reconnected = Peer(hub, "victim")
    reconnected.session = victim.session
    assert isinstance(reconnected.register(), P.Welcome)
    assert not hub.ledger.leases  # a re-registration voids the old leases (their prompts are pending again)
    for p in (victim, attacker, reconnected):
        p.close()


def test_weights_are_served_to_registered_generators_only_and_a_few_chunks_at_a_time(hubs):
    hub = hubs(weights={"chunk_mb": 1})
    hub.weights.blobs.put(0, bytes(range(256)) * (40 * 4096))  # 40 MB
    stranger = Peer(hub, "stranger")
    reply = stranger.ask(P.WeightsFetch(0, 0, 2**20, "stranger"))
    assert isinstance(reply, P.Error) and "unknown generator" in reply.message
    # a registered generator that asks for everything and reads nothing: its reply queue stays bounded
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(hub.address)
    sock.send(P.encode(P.Register("greedy", spec_digest=hub.membership.spec_digest), 1))
    assert sock.poll(5000)
    P.decode(sock.recv(), limits=P.FROM_HUB)
    for i in range(40):
        sock.send(P.encode(P.WeightsFetch(0, i * 2**20, 2**31, "greedy"), 2 + i))  # asks for 2 GB each
    replies = []
    while sock.poll(2000) and len(replies) < 40:
        replies.append(P.decode(sock.recv(), limits=P.FROM_HUB)[0])
    chunks = [r for r in replies if isinstance(r, P.WeightsChunk)]
    refused = [r for r in replies if isinstance(r, P.Error)]
    print(f"40 requests: {len(chunks)} chunks served, {len(refused)} refused while chunks were in flight")
    assert len(replies) == 40 and refused and "chunks of 1 MB in flight" in refused[0].message
    assert all(len(c.data) == 2**20 for c in chunks)  # never more than weights.chunk_mb, whatever was asked
    sock.close(0)
    ctx.term()
    stranger.close()


def test_registrations_are_bounded(hubs):
    hub = hubs(hub={"max_generators": 2})
    peers = [Peer(hub, f"g{i}") for i in range(3)]
    assert isinstance(peers[0].register(), P.Welcome) and isinstance(peers[1].register(), P.Welcome)
    refused = peers[2].register()
    assert isinstance(refused, P.Error) and refused.stop and "hub.max_generators" in refused.message
    bad = Peer(hub, "bad id with spaces")
    reply = bad.register(gpus="0;rm -rf")
    assert isinstance(reply, P.Error) and reply.stop and "generator_id" in reply.message
    assert set(hub.registry.generators) == {"g0", "g1"}
    for p in peers + [bad]:
        p.close()


def test_a_lease_not_returned_in_time_or_no_longer_reported_goes_back_to_the_queue(hubs, tmp_path):
    hub = hubs(hub={"lease_timeout_s": 0.5, "heartbeat_timeout_s": 60})
    peer = Peer(hub)
    peer.register()
    slow = peer.lease(2)
    # it keeps heart-beating and reporting the lease, but never delivers: after lease_timeout_s it is re-queued
    wait_until(lambda: peer.ask(P.Heartbeat(peer.id, 0, lease_ids=[slow.lease_id])).dead_leases)
    assert hub.counters["lost_leases"] == 1 and peer.id in hub.registry.generators
    assert list(hub.ledger.pending)[:2] == [(g.epoch, g.prompt_id) for g in slow.groups]
    hub.cfg.hub.lease_timeout_s = 600
    forgotten = peer.lease(2)
    # done with it, it says, and 2 rollouts sent that the hub has not seen yet (another socket): not lost yet
    for _ in range(3):
        assert isinstance(peer.ask(P.Heartbeat(peer.id, 0, pushed=2)), P.HeartbeatReply)
        assert forgotten.lease_id in hub.ledger.leases
    assert isinstance(peer.ask(P.Heartbeat(peer.id, 0)), P.HeartbeatReply) and forgotten.lease_id in hub.ledger.leases
    peer.ask(P.Heartbeat(peer.id, 0))  # the second heartbeat in a row without it, nothing in flight: lost
    assert forgotten.lease_id not in hub.ledger.leases and hub.counters["lost_leases"] == 2
    peer.send_groups(slow)  # a late delivery of a re-queued lease is recognised and dropped
    wait_until(lambda: hub.counters["unknown_lease"] == 2)
    assert not hub.ledger.buffer
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events.count("lease_expired") == 2
    peer.close()


def test_one_generator_cannot_reject_prompts_or_stop_the_run_while_another_can_take_them(hubs):
    hub = hubs(hub={"max_rejected_prompts": 2}, trainer={"batch_size": 4})  # a window of 8 groups
    liar, honest = Peer(hub, "liar"), Peer(hub, "honest")
    liar.register()
    honest.register()
    refused = []
    for _ in range(4):  # the liar refuses every prompt it is leased
        lease = liar.lease(1)
        item = lease.groups[0]
        refused.append((item.epoch, item.prompt_id))
        liar.ask(P.GroupFailed("liar", lease.lease_id, item.epoch, item.prompt_id, "too long", "prompt"))
    assert hub.counters["rejected_prompts"] == 0 and not hub.failure
    assert not {(g.epoch, g.prompt_id) for g in liar.lease(4).groups} & set(refused)  # not leased to it again
    taken = honest.lease(4)
    assert set(refused) <= {(g.epoch, g.prompt_id) for g in taken.groups}  # the other generator gets them
    # a prompt both refuse is rejected for the epoch: the fault is confirmed
    item = next(g for g in taken.groups if (g.epoch, g.prompt_id) == refused[0])
    honest.ask(P.GroupFailed("honest", taken.lease_id, item.epoch, item.prompt_id, "too long", "prompt"))
    assert hub.counters["rejected_prompts"] == 1 and not hub.failure
    liar.close()
    honest.close()


def test_reward_function_errors_are_errors_of_the_run_not_of_the_prompt(hubs, tmp_path):
    hub = hubs(hub={"max_reward_errors": 2})
    peer = Peer(hub)
    peer.register()
    traceback = 'Traceback (most recent call last):\n  File "rewards.py", line 3, in f\nZeroDivisionError: boom'
    keys = []
    for _ in range(2):
        lease = peer.lease(1)
        item = lease.groups[0]
        keys.append((item.epoch, item.prompt_id))
        peer.ask(P.GroupFailed(peer.id, lease.lease_id, item.epoch, item.prompt_id,
                               f"reward function my.rewards:f: {traceback}", "reward"))
    assert hub.counters["rejected_prompts"] == 0 and set(keys) <= set(hub.ledger.pending)  # the prompts are not lost
    with pytest.raises(HubStopped, match=r"reward functions raised 2 times(.|\n)*ZeroDivisionError: boom"):
        hub.take_batch(0)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["prompt_id"] for e in events if e["event"] == "reward_error"] == [k[1] for k in keys]
    reply = peer.lease(1)  # generators hear that the run failed, and why
    assert isinstance(reply, P.Error) and reply.stop and "ZeroDivisionError" in reply.message
    peer.close()


def test_reward_errors_from_one_generator_of_two_do_not_stop_the_run(hubs):
    hub = hubs(hub={"max_reward_errors": 1})
    liar, honest = Peer(hub, "liar"), Peer(hub, "honest")
    liar.register()
    honest.register()
    for _ in range(3):
        lease = liar.lease(1)
        item = lease.groups[0]
        liar.ask(P.GroupFailed("liar", lease.lease_id, item.epoch, item.prompt_id, "boom", "reward"))
    assert hub.counters["reward_errors"] == 3 and not hub.failure
    liar.close()
    honest.close()


def test_a_failure_of_the_hub_thread_stops_the_learner_with_it(hubs):
    hub = hubs()

    def broken():
        raise RuntimeError("a bug outside the message handlers")

    hub.tick = broken
    wait_until(lambda: hub.failure)  # (without the fix the thread dies silently and the learner waits forever)
    with pytest.raises(HubStopped, match=r"the hub thread failed(.|\n)*a bug outside the message handlers"):
        hub.take_batch(0)


def test_an_exhausted_dataset_ends_the_run_with_a_clear_message(hubs):
    hub = hubs(echo_rows(5, 0), trainer={"epochs": 1, "total_steps": 100})
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(8)
    assert len(lease.groups) == 4  # (k + 1) x batch_size: the window
    peer.send_groups(lease)
    wait_until(lambda: len(hub.ledger.buffer) == 4)
    for step in range(2):
        hub.take_batch(step)
        hub.finish_step(step + 1)
    last = peer.lease(8)
    peer.send_groups(last, version=2)
    wait_until(lambda: len(hub.ledger.buffer) == 1)
    assert isinstance(peer.lease(8), P.Wait)
    with pytest.raises(DatasetExhausted, match="trainer.epochs=1 over 5 prompts gave 4 trained groups, 1 left"):
        hub.take_batch(2)
    peer.close()


def test_prompts_no_engine_can_take_are_rejected_by_the_hub_without_leasing_them(hubs, tmp_path):
    rows = echo_rows(6, 0)
    rows[1] = {**rows[1], "prompt": ""}  # empty after tokenising
    rows[2] = {**rows[2], "prompt": " ".join(["1"] * 12)}  # 12 tokens: no room within max_model_len=12
    hub = hubs(rows, generator={"max_model_len": 12}, trainer={"epochs": 1})
    peer = Peer(hub)
    peer.register()
    lease = peer.lease(8)
    assert {g.prompt_id for g in lease.groups} == {0, 3, 4, 5}
    events = map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
    reasons = {e["prompt_id"]: e["reason"] for e in events if e["event"] == "prompt_rejected"}
    assert reasons[1] == "empty after tokenising" and "12 tokens leave no room" in reasons[2]
    assert hub.counters["rejected_prompts"] == 2
    peer.close()


def test_a_flood_of_bad_messages_is_dropped_undecoded_and_others_are_served(hubs):
    hub = hubs()
    flood, honest = Peer(hub, "flood"), Peer(hub, "honest")
    honest.register()
    for _ in range(500):
        flood.sock.send(b"\x00" * 64)
    wait_until(lambda: hub.counters["bad_messages"] + hub.counters["muted"] == 500)
    assert hub.counters["bad_messages"] <= 21 + 1 and hub.counters["muted"] >= 400  # decoded: about 20 a second
    assert isinstance(honest.ask(P.Heartbeat("honest", 0)), P.HeartbeatReply)  # another connection is served as usual
    time.sleep(1.1)
    while flood.sock.poll(100):  # the error replies to the first few
        flood.sock.recv()
    assert isinstance(flood.register(), P.Welcome)  # a second later it is heard again
    flood.close()
    honest.close()


def test_a_generator_whose_rollouts_keep_being_rejected_is_quarantined_and_others_go_on(hubs):
    """It took prompts from the window only to return them invalid: after hub.max_rejected_rollouts it is dropped,
    its leases go back to the queue, and its registration is refused (with the reason) for hub.quarantine_s."""
    hub = hubs(hub={"max_rejected_rollouts": 3}, trainer={"batch_size": 4})  # each may hold 4 of the 8 groups
    rogue, honest = Peer(hub, "rogue"), Peer(hub, "honest")
    rogue.register()
    honest.register()
    lease = rogue.lease(4)
    for item in lease.groups[:3]:
        rogue.send(rogue.group(lease, item, logprobs=(math.nan, -1.0)))
    wait_until(lambda: "rogue" not in hub.registry.generators)
    assert hub.counters["quarantined"] == 1 and hub.counters["rejected/logprob"] == 3 and not hub.ledger.leases
    assert {(g.epoch, g.prompt_id) for g in lease.groups} <= set(hub.ledger.pending)  # nothing lost
    assert rogue.lease(1).fatal  # forgotten: "register again"
    refused = rogue.register()
    assert refused.stop and "quarantined" in refused.message and "logprob" in refused.message
    again = honest.lease(4)
    honest.send_groups(again)
    wait_until(lambda: len(hub.ledger.buffer) == 4)  # the honest generator is served as before
    quarantine = [json.loads(line) for line in (hub.run_dir / "events.jsonl").read_text().splitlines()
                  if '"quarantine"' in line]
    assert quarantine and quarantine[0]["generator"] == "rogue"
    rogue.close()
    honest.close()


def test_one_generator_cannot_fill_the_journal_or_claim_a_version_never_published(hubs):
    """A flood of WeightsApplied (the fuzzer's: 20,000 in 2 s, never muted, every one journaled): a repeat is
    acknowledged and not journaled, a version never published is refused, and what one principal has written to
    events.jsonl is bounded a minute (hub.journal_kib_per_minute); another generator's events are still written."""
    hub = hubs(hub={"journal_kib_per_minute": 4})
    flood = Peer(hub, "flood")
    flood.register()
    hub.finish_step(1)
    hub.announce(P.WeightsReady(1, file=P.FileVersion(0, 0)), None)
    for i in range(600):
        assert isinstance(flood.ask(P.WeightsApplied("flood", i % 2, via="x" * 16)), P.Ack)
    claim = flood.ask(P.WeightsApplied("flood", 10**12 + 19_999))
    assert isinstance(claim, P.Error) and "never published" in claim.message
    assert hub.status().generators[0].version == 1  # the claim changed nothing (its last was 599 % 2)
    other = Peer(hub, "other")
    other.register()
    lines = (hub.run_dir / "events.jsonl").read_text().splitlines(keepends=True)
    events = [json.loads(line) for line in lines]
    written = sum(len(line) for line, e in zip(lines, events, strict=True) if e.get("generator") == "flood")
    assert written <= 4 * 1024 and hub.counters["journal_dropped"] > 500
    assert [e["event"] for e in events if e.get("generator") == "other"] == ["register"]
    flood.close()
    other.close()


def test_one_generator_cannot_hold_the_window_another_needs(hubs):
    """A peer asks for leases until none is left: it gets what leaves every other registered principal room for a
    lease (generator.lease_size, or its equal part of the window when smaller), not the whole window; the room left
    is the other's, and the rest of the window is the greedy one's (a large engine beside a small one fills it)."""
    hub = hubs(trainer={"batch_size": 8}, generator={"lease_size": 4})  # a window of 16 groups, leases of 4
    greedy, polite = Peer(hub, "greedy"), Peer(hub, "polite")
    greedy.register()
    polite.register()
    taken = []
    while isinstance(lease := greedy.lease(4), P.Lease):
        taken += lease.groups
    assert len(taken) == 12 and "kept for other generators" in lease.reason
    second = polite.lease(4)
    assert isinstance(second, P.Lease) and len(second.groups) == 4
    greedy.close()
    polite.close()


def test_a_lease_whose_holder_makes_no_progress_goes_back_and_another_generator_gets_it(hubs):
    """A generator whose engine hangs while its heartbeats go on (or a peer listing leases it never works on) holds
    them no longer than hub.progress_timeout_s: no tokens, no group. Another generator then gets those prompts; the
    stalled one gets one group a lease until it progresses; one that reports tokens keeps its lease."""
    hub = hubs(hub={"progress_timeout_s": 1.0, "heartbeat_s": 0.1, "heartbeat_timeout_s": 60},
               trainer={"batch_size": 2})  # a window of 4 groups
    hung, busy = Peer(hub, "hung"), Peer(hub, "busy")
    hung.register()
    held = hung.lease(8)
    assert len(held.groups) == 4
    busy.register()
    assert isinstance(busy.lease(8), P.Wait)  # the window is full
    tokens, dead = 0, []
    deadline = time.monotonic() + 20  # the bound is 1 s; generous for a loaded machine
    while not isinstance(got := busy.lease(8), P.Lease):
        assert time.monotonic() < deadline, "the stalled generator kept its leases"
        dead += hung.ask(P.Heartbeat("hung", 0, lease_ids=[held.lease_id], generated=7)).dead_leases
        tokens += 1
        busy.ask(P.Heartbeat("busy", 0, generated=tokens))
        time.sleep(0.05)
    assert {(g.epoch, g.prompt_id) for g in got.groups} <= {(g.epoch, g.prompt_id) for g in held.groups}
    wait_until(lambda: hung.ask(P.Heartbeat("hung", 0, lease_ids=[held.lease_id], generated=7)).dead_leases)
    assert hub.counters["lost_leases"] == 1 and "no progress" in (hub.run_dir / "events.jsonl").read_text()
    probe = hung.lease(8)
    assert isinstance(probe, P.Lease) and len(probe.groups) == 1  # stalled: one group until it shows progress
    until = time.monotonic() + 2.5  # twice the bound and more: a generator reporting tokens keeps its lease
    while time.monotonic() < until:
        tokens += 1
        assert busy.ask(P.Heartbeat("busy", 0, lease_ids=[got.lease_id], generated=tokens)).dead_leases == []
        time.sleep(0.1)
    assert got.lease_id in hub.ledger.leases
    hung.close()
    busy.close()


# (message, what the generator sends): every number at the edges of what msgpack carries
EDGES = [2**64 - 1, -(2**63), 2**63]
FLOATS = [math.nan, math.inf, -math.inf]


def test_no_value_a_peer_sends_makes_a_handler_fail_or_status_unanswered(hubs):
    """The fuzzer's finding: a Heartbeat or WeightsApplied with version 2**64-1 from the registered connection made
    every StatusRequest fail to encode (a lag past int64) for as long as the generator reported it. Every message a
    generator may send, with numbers at the edges, gets an answer, and status is answered after each."""
    hub = hubs()
    peer = Peer(hub, "edge")
    peer.register()
    lease = peer.lease(2)
    item = lease.groups[0]
    sent = []
    for v in EDGES:
        sent += [P.Heartbeat("edge", v), P.WeightsApplied("edge", v), P.LeaseRequest("edge", v),
                 P.Heartbeat("edge", 0, inflight_groups=v, lease_ids=[v, lease.lease_id], pushed=v, generated=v),
                 P.GroupFailed("edge", v, v, v, "x"), P.GroupFailed("edge", lease.lease_id, item.epoch, v, "x"),
                 P.WeightsFetch(v, v, v, "edge"), P.WeightsFetch(0, 0, v, "edge"),
                 P.Register("edge", loaded_version=v, loaded_run="test", session=peer.session,
                            spec_digest=hub.membership.spec_digest),
                 P.Register("edge", pid=v, tensor_parallel=v, session=peer.session,
                            spec_digest=hub.membership.spec_digest, adapter_slots=v),
                 P.SpecRequest("edge", {"trainer.group_size": v, "model.lora.r": [v]}, {"model.path": str(v)}),
                 P.SetRequest("trainer.max_staleness", v), P.SetRequest("generator.lease_size", [v])]
    sent += [P.Heartbeat("edge", 0, tokens_per_s=f) for f in FLOATS]
    sent += [P.WeightsApplied("edge", 0, load_ms=f) for f in FLOATS]
    sent += [P.SetRequest("sampling.temperature", f) for f in FLOATS]
    for msg in sent:
        reply = peer.ask(msg)  # (no reply at all: the handler failed)
        assert reply is not None
        status = peer.ask(P.StatusRequest())
        assert isinstance(status, P.StatusReply), (msg, status)
        render(status)
    for v in EDGES:
        peer.send(peer.group(lease, item, lease_id=v, epoch=v, prompt_id=v))
        peer.send(peer.group(lease, item, sample={"first_version": v, "last_version": v}))
        peer.send(peer.group(lease, item, sample={"first_version": -(2**63), "last_version": v}))
    wait_until(lambda: hub.counters["unknown_lease"] + hub.counters["rejected_rollouts"] >= 9)
    assert isinstance(peer.ask(P.StatusRequest()), P.StatusReply)
    assert isinstance(peer.ask(P.Leave("edge", returned_leases=EDGES, reason="x")), P.Ack)
    assert hub.counters["bad_messages"] == 0  # a handler that failed is counted here
    peer.close()
