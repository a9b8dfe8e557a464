"""Evaluation rounds at the lease desk (hub/evaluation.py, hub/leases.py), over real ZeroMQ sockets, in process: when a
round's prompts are leased beside training, scored and never trained."""

import json

import pytest

from pipeline import protocol as P
from tests.unit.peers import Peer, wait_until


def test_an_evaluation_round_takes_the_room_training_leaves_is_scored_and_not_trained(tmp_path):
    """eval.every: at version 0 and every 2 versions, the held-out prompts are leased once training has no room for a
    generator, outside admission, with eval.samples samples each; what comes back is scored (eval.jsonl and
    `evaluations`), never buffered; a lease lost with its generator goes back to its round; heartbeats keep eval
    leases alive."""
    from pipeline.tasks import echo_rows
    from tests.unit.peers import new_hub

    hub = new_hub(tmp_path, eval_rows=echo_rows(3, 1), eval={"every": 2, "samples": 3, "max_prompts": 3,
                                                              "temperature": 0.7})
    try:
        peer = Peer(hub)
        peer.register()
        training = peer.lease(4)
        assert not training.eval and training.sampling.temperature == 1.0  # training first: the whole window
        first = peer.lease(2)
        assert first.eval and first.group_size == 3 and first.sampling.temperature == 0.7 and len(first.groups) == 2
        assert peer.ask(P.Heartbeat(peer.id, 0, 0.0, 0, [first.lease_id])).dead_leases == []
        peer.close()
        with hub.lock:
            hub.membership.drop(peer.id, "left")  # its leases go back: the eval one to its round
        peer = Peer(hub, "gen-u")
        peer.register()
        assert not peer.lease(4).eval
        lease = peer.lease(8)
        assert lease.eval and len(lease.groups) == 3
        other = Peer(hub, "gen-v")  # another generator cannot take a prompt out of this generator's eval lease
        other.register()
        item = lease.groups[0]
        failed = P.GroupFailed(other.id, lease.lease_id, item.epoch, item.prompt_id, reason="x", kind="engine")
        assert other.ask(failed).known is False
        assert len(hub.evaluation.leases[lease.lease_id].items) == 3
        other.ask(P.Leave(other.id))  # (registered, it would keep its part of the window)
        other.close()
        rewards = {0: [1.0, 0.0, 0.0], 1: [0.0, 0.0, 0.0], 2: [1.0, 1.0, 1.0]}
        hub.finish_step(1)  # version 1 is out while the round's last group is sampled: it ends under it (inflight)
        for i, item in enumerate(lease.groups):
            group = peer.group(lease, item, group_size=3)
            for s, r in zip(group.samples, rewards[i], strict=True):
                s.reward, s.rewards = r, [r]
                s.last_version = 1 if i == 2 else 0
            peer.send(group)
        wait_until(lambda: hub.evaluation.finished)
        (done,) = hub.evaluations()
        assert done["version"] == 0 and done["eval/prompts"] == 3
        assert done["eval/behaviour_version"] == 0 and done["eval/newest_version"] == 1  # the versions it spans
        assert done["eval/mixed_samples"] == 3  # the last group's samples began under v0 and ended under v1
        assert done["eval/reward_mean"] == pytest.approx(4 / 9) and done["eval/pass@3"] == pytest.approx(2 / 3)
        assert done["eval/pass@1"] == pytest.approx(4 / 9)
        assert not hub.ledger.buffer and len(hub.ledger.leases) == 1  # nothing of it buffered for training
        assert json.loads((tmp_path / "eval.jsonl").read_text())["eval/pass@3"] == pytest.approx(2 / 3)
        assert not getattr(peer.lease(2), "eval", False)  # version 1: no round
        hub.finish_step(2)
        assert any(getattr(peer.lease(2), "eval", False) for _ in range(2))  # version 2: the next round, in turn
        peer.close()
    finally:
        hub.stop()


def test_a_round_shares_an_engine_with_training_only_a_lease_at_a_time_unless_it_is_overdue(tmp_path):
    """While training goes on, a generator holds at most generator.lease_size of a round's prompts, and gets them
    only when the window has no room for it; a round still out when the next one starts (overdue) is not capped (and
    takes turns with training)."""
    from pipeline.tasks import echo_rows
    from tests.unit.peers import new_hub

    hub = new_hub(tmp_path, eval_rows=echo_rows(12, 1), eval={"every": 1, "samples": 2, "max_prompts": 12},
                  generator={"lease_size": 3})
    try:
        peer = Peer(hub)
        peer.register()
        assert not peer.lease(8).eval and not peer.lease(8).eval  # the window (2 x 2 groups) in leases of 3 and 1
        first = peer.lease(8)
        assert first.eval and len(first.groups) == 3  # no room for training: a lease's worth of the round
        assert isinstance(peer.lease(8), P.Wait)  # 3 in flight: no more until some come back
        for item in first.groups[:2]:
            peer.send(peer.group(first, item, group_size=2))
        wait_until(lambda: hub.evaluation.held(peer.id) == 1)
        assert len(peer.lease(8).groups) == 2  # room for 2 of the round again
        hub.finish_step(1)  # the next round starts: version 0's, with prompts left, is overdue
        with hub.lock:
            assert hub.evaluation.overdue(1)
        overdue = peer.lease(8)  # 3 of the round in flight, but it is overdue: no cap, a lease's worth more
        assert overdue.eval and len(overdue.groups) == 3 and overdue.min_version == 0
        peer.close()
    finally:
        hub.stop()


def test_the_version_0_evaluation_never_holds_the_first_step(tmp_path):
    """A round of many held-out prompts at version 0 and an engine with room for all of them: the generator's first
    lease is training's, and the first batch is taken while the round is still out (before this, the whole round
    was leased first and the first step waited for it)."""
    from pipeline.tasks import echo_rows
    from tests.unit.peers import new_hub

    hub = new_hub(tmp_path, eval_rows=echo_rows(40, 1), eval={"every": 5, "samples": 2, "max_prompts": 40},
                  generator={"lease_size": 64})
    try:
        peer = Peer(hub)
        peer.register()
        training = peer.lease(64)
        assert not training.eval and len(training.groups) == 4  # the window: (k + 1) x batch_size
        evaluation = peer.lease(64)
        assert evaluation.eval and len(evaluation.groups) == 40
        for item in training.groups:
            peer.send(peer.group(training, item))
        batch, _, _ = hub.take_batch(0)
        assert len(batch) == 2 and hub.evaluation.busy()  # the first step's batch, the round not in
        peer.close()
    finally:
        hub.stop()


def test_a_round_goes_first_while_the_buffer_feeds_the_learner_through_it(tmp_path):
    """At a large k training always has room, so a round that only took the window's gaps was sampled by weights long
    past its version (at k = 8 a round labelled v10 by versions 20-40). Once the groups buffered beyond the learner's
    next batch hold as many samples as the round has left, the round's prompts go first, a lease's worth at a time and
    not capped; with fewer buffered, or once the learner takes a batch, training goes first again."""
    from pipeline.tasks import echo_rows
    from tests.unit.peers import new_hub

    hub = new_hub(tmp_path, eval_rows=echo_rows(4, 1), eval={"every": 5, "samples": 2, "max_prompts": 4},
                  trainer={"max_staleness": 4}, generator={"lease_size": 3})
    try:
        peer = Peer(hub)
        peer.register()
        first, second = peer.lease(3), peer.lease(3)  # nothing buffered: training first (the window holds 10 groups)
        assert not first.eval and not second.eval
        peer.send_groups(first)
        for item in second.groups[:2]:
            peer.send(peer.group(second, item))
        wait_until(lambda: len(hub.ledger.buffer) == 5)
        # a batch (2 groups) and 3 more, of 2 samples each: 6 samples, where the round has 4 x 2 = 8 left to sample
        third = peer.lease(1)
        assert not third.eval
        peer.send(peer.group(second, second.groups[2]))
        peer.send_groups(third)
        wait_until(lambda: len(hub.ledger.buffer) == 7)  # 5 groups past the next batch: 10 samples
        rounds = [peer.lease(3), peer.lease(3)]
        assert [len(lease.groups) for lease in rounds] == [3, 1] and all(lease.eval for lease in rounds)
        assert all(lease.min_version == 0 for lease in rounds)
        assert hub.evaluation.held(peer.id) == 4  # past generator.lease_size: not capped while the learner is fed
        batch, _, _ = hub.take_batch(0)
        assert len(batch) == 2
        assert not peer.lease(3).eval  # the round is all leased: training
        peer.close()
    finally:
        hub.stop()
