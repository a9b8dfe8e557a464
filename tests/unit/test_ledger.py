"""The prompt ledger and the staleness rules, without sockets or threads: every prompt is in exactly one place."""

from __future__ import annotations

import itertools
import json
import pickle
import random
from collections import Counter

import pytest

from hub.ledger import LeaseState, PromptLedger
from pipeline import protocol as P
from pipeline import staleness

COUNTERS = ("requeued", "stale_dropped", "skipped_steps")


def ledger(n=6, epochs=0) -> PromptLedger:
    return PromptLedger(n, epochs, seed=0, counters=dict.fromkeys(COUNTERS, 0))


def lease(book: PromptLedger, lease_id: int, n: int, gen="g") -> LeaseState:
    keys = book.take(n, gen, lambda tried: False)
    state = LeaseState(lease_id, gen, {k: P.PromptItem(k[1], k[0], "p") for k in keys}, 1.0, 0, 0.0)
    book.grant(state)
    return state


def group(key, version=0) -> P.RolloutGroup:
    samples = [P.Sample(b"", b"", 0.0, first_version=version, last_version=version)]
    return P.RolloutGroup(1, "g", key[1], key[0], b"", samples)


def train(book: PromptLedger, state: LeaseState, version: int = 0) -> None:
    """Every group of the lease arrives and is trained in one step."""
    for key in list(state.items):
        book.settle(state.lease_id, key)
        book.buffered(group(key, version))
    book.batch(version, 0, len(book.buffer))
    book.finish_step()


def places(book: PromptLedger) -> Counter:
    """How often each prompt of epoch 0 appears across the ledger's places (each must be exactly once). The groups on
    leases the ledger counts as they change are those its leases hold, in all and by principal (here, generator)."""
    by_gen = Counter()
    for le in book.leases.values():
        by_gen[le.generator_id] += len(le.items)
    assert book.leased == sum(by_gen.values()) and book.held.by == {g: n for g, n in by_gen.items() if n}
    for g in by_gen:
        assert sorted(le.lease_id for le in book.leases_of(g)) == sorted(
            le.lease_id for le in book.leases.values() if le.generator_id == g)
    where = list(book.pending) + [k for le in book.leases.values() for k in le.items]
    where += [(g.epoch, g.prompt_id) for g, *_ in book.buffer] + [(g.epoch, g.prompt_id) for g in book.in_step]
    where += [(0, pid) for pid in range(book.n_prompts) if book.done((0, pid))]
    return Counter(k for k in where if k[0] == 0)


def test_a_prompt_is_in_exactly_one_place_through_leases_steps_and_failures():
    book = ledger()
    a, b = lease(book, 1, 3), lease(book, 2, 3)
    assert len(book.pending) == 0 and book.next_epoch == 1 and book.in_flight() == 6
    for key in list(a.items)[:2]:  # two groups of a arrive
        book.settle(1, key)
        book.buffered(group(key))
    book.take_back(2)  # b's generator is gone: its prompts go back to the front, in order
    assert list(book.pending) == list(b.items) and book.counters["requeued"] == 3
    batch, dropped, _ = book.batch(step=0, k=0, size=2)
    assert len(batch) == 2 and dropped == 0 and book.in_step == batch
    book.abandon_step()  # not finite: leased again
    assert book.counters["skipped_steps"] == 1 and len(book.pending) == 5
    assert set(places(book).values()) == {1} and len(places(book)) == 6
    c = lease(book, 3, 5)
    for key in list(c.items):
        book.settle(3, key)
        book.buffered(group(key))
    batch, _, _ = book.batch(step=0, k=0, size=4)
    book.finish_step()
    assert book.trained == 4 and set(places(book).values()) == {1} and len(places(book)) == 6


def test_stale_groups_are_dropped_and_leased_again_and_a_batch_takes_the_oldest_first():
    book = ledger()
    keys = list(lease(book, 1, 4).items)
    for key, version in zip(keys, (0, 2, 1, 2), strict=True):
        book.settle(1, key)
        book.buffered(group(key, version))
    batch, dropped, _ = book.batch(step=2, k=1, size=2)  # lag of version 0 at step 2 is 2 > k
    assert dropped == 1 and book.pending[0] == keys[0] and book.counters["stale_dropped"] == 1
    assert [staleness.behaviour_version(g) for g in batch] == [1, 2]


def test_the_groups_ahead_of_a_batch_are_those_it_takes_first_and_looking_moves_nothing():
    """`ahead` (learner/early.py computes their proximal log-probs while the learner waits): the fresh buffered groups,
    oldest first, up to a batch; the stale one is neither among them nor dropped by looking."""
    book = ledger()
    keys = list(lease(book, 1, 5).items)
    for key, version in zip(keys[:4], (2, 0, 1, 2), strict=True):
        book.settle(1, key)
        book.buffered(group(key, version))
    before = list(book.buffer), list(book.pending), dict(book.counters)
    ahead = book.ahead(step=2, k=1, size=3)
    assert [(g.prompt_id, staleness.behaviour_version(g)) for g in ahead] == [(keys[2][1], 1), (keys[0][1], 2),
                                                                              (keys[3][1], 2)]
    assert (list(book.buffer), list(book.pending), dict(book.counters)) == before and not book.in_step
    book.settle(1, keys[4])
    book.buffered(group(keys[4], 1))  # an older group arrives: it goes ahead of the newer ones
    ahead = book.ahead(step=2, k=1, size=3)
    assert [g.prompt_id for g in ahead] == [keys[2][1], keys[4][1], keys[0][1]]
    batch, dropped, _ = book.batch(step=2, k=1, size=3)
    assert batch is not None and [id(g) for g in batch] == [id(g) for g in ahead] and dropped == 1


def test_a_prompt_one_principal_failed_goes_to_another_first():
    book = ledger(n=3)
    first = lease(book, 1, 1, gen="a")
    key = next(iter(first.items))
    book.settle(1, key)
    attempts, tried = book.failed(key, "a")
    book.requeue([key])
    assert attempts == 1 and tried == {"a"}
    assert key not in book.take(1, "a", lambda t: len(t) >= 2)  # a again: skipped while b could try it
    assert book.pending[0] == key
    assert book.take(1, "b", lambda t: len(t) >= 2) == [key]


def test_snapshot_restores_leased_and_buffered_prompts_as_pending_and_exhaustion_ends_an_epoch():
    book = ledger(n=4, epochs=1)
    held = lease(book, 1, 4)
    key = next(iter(held.items))
    book.settle(1, key)
    book.buffered(group(key))
    state = book.snapshot()
    again = ledger(n=4, epochs=1)
    again.restore(state)
    assert sorted(again.pending) == sorted(held.items | {key: None}) and again.next_epoch == 1
    assert not again.exhausted()
    for i in range(4):
        train(again, lease(again, 10 + i, 1))
        assert again.exhausted() == (i == 3)


def test_admission_bounds_groups_in_flight_by_k_plus_one_batches():
    assert staleness.room(version=0, in_flight=0, total_steps=10, batch_size=4, k=1) == (8, "")
    assert staleness.room(0, 8, 10, 4, 1) == (0, "staleness window full")
    assert staleness.room(9, 4, 10, 4, 1) == (0, "waiting for the last steps")
    assert staleness.min_version(version=5, in_flight=8, batch_size=4, k=1) == 5
    assert staleness.min_version(version=5, in_flight=0, batch_size=4, k=1) == 4


def test_dynamic_sampling_filters_a_group_without_signal_once_and_for_its_epoch():
    """A filtered group's prompt is done for its epoch: never leased again, kept across a checkpoint, and counted;
    every prompt is still in exactly one place, and the epoch ends when all are trained or filtered."""
    book = ledger(n=4, epochs=1)
    keys = list(lease(book, 1, 4).items)
    for key in keys:
        book.settle(1, key)
    book.filter(group(keys[0]))
    for key in keys[1:]:
        book.buffered(group(key))
    assert book.counters["filtered_groups"] == 1 and book.done(keys[0]) and book.in_flight() == 3
    assert set(places(book).values()) == {1} and len(places(book)) == 4
    batch, _, _ = book.batch(step=0, k=0, size=3)
    book.finish_step()
    again = ledger(n=4, epochs=1)
    again.restore(book.snapshot())
    assert again.done(keys[0]) and again.exhausted()
    book.requeue([keys[0]])  # a late duplicate lease of it: skipped when taken
    assert book.take(4, "g", lambda t: False) == []


def test_the_ledger_keeps_about_one_epoch_of_keys_however_many_epochs_pass():
    """Trained keys of finished epochs are not kept: the ledger after 30 epochs is no larger than after 3 (it kept
    every trained key of every epoch, and a checkpoint sorted them all under the hub's lock)."""
    book = ledger(n=40)
    sizes = {}
    for epoch in range(30):
        for i in range(4):
            train(book, lease(book, epoch * 10 + i, 10), epoch)
        sizes[epoch] = len(pickle.dumps(book))
    assert sizes[29] <= sizes[2] + 256, sizes
    assert book.trained == 30 * 40 and book.next_epoch >= 30


def test_a_checkpoint_is_the_size_of_the_window_not_of_the_dataset():
    """A ledger of 50,000 prompts, mid-epoch: the state lists what is out and the rest of the epoch by its length, so
    taking it under the hub's lock and writing it as JSON cost about as much as for 200 prompts."""
    for n in (200, 50_000):
        book = ledger(n=n, epochs=0)
        held = lease(book, 1, 8)
        train(book, lease(book, 2, 8))
        state = book.snapshot()
        assert len(json.dumps(state)) < 1000, n
        again = ledger(n=n, epochs=0)
        again.restore(json.loads(json.dumps(state)))
        assert list(again.pending)[:8] == list(held.items) and list(again.pending)[8:] == list(book.pending)
        assert again.trained == 8 and again.in_flight() == 0


def test_every_prompt_of_each_epoch_is_trained_exactly_once_across_resumes():
    """Random leases, arrivals, take-backs, rejections, filtered groups, stale drops and skipped steps over three
    epochs, with the ledger saved and restored (JSON) between steps every so often, as a resumed learner: every
    prompt of each epoch ends up trained once, or filtered or rejected once, never both, never twice."""
    rng = random.Random(1)
    n, epochs = 23, 3
    book = ledger(n=n, epochs=epochs)
    trained, gone = Counter(), Counter()
    lease_ids = itertools.count(1)
    step = 0
    while not book.exhausted() or book.buffer:
        for _ in range(rng.randrange(1, 4)):
            state = lease(book, next(lease_ids), rng.randrange(1, 6))
            for key in list(state.items):
                fate = rng.random()
                if fate < 0.2:  # not delivered: its lease is taken back later (expired, generator gone)
                    continue
                book.settle(state.lease_id, key)
                if fate < 0.25:
                    book.reject(key)
                    gone[key] += 1
                elif fate < 0.3:
                    book.filter(group(key, step))
                    gone[key] += 1
                else:
                    book.buffered(group(key, step - rng.randrange(0, 3)))
        for lease_id in [i for i in book.leases if rng.random() < 0.3]:  # some leases stay out across a checkpoint
            book.take_back(lease_id)
        # the last groups of the last epoch make a smaller batch
        batch, _, _ = book.batch(step, 1, 4 if not book.exhausted() else max(1, len(book.buffer)),
                                 for_last_chance=rng.random() < 0.5)  # held for a lease, or waited long enough
        if batch is None:
            continue
        if rng.random() < 0.1:
            book.abandon_step()
            continue
        trained.update((g.epoch, g.prompt_id) for g in batch)
        book.finish_step()
        step += 1
        if rng.random() < 0.3:  # a checkpoint, and a learner resumed from it
            snapshot = json.loads(json.dumps(book.snapshot()))
            counters, book = book.counters, ledger(n=n, epochs=epochs)
            book.restore(snapshot)
            book.counters.update(counters)  # (the hub saves and restores them)
    assert book.counters["stale_dropped"] and book.counters["skipped_steps"]  # (the random walk took these paths)
    everything = {(e, p) for e in range(epochs) for p in range(n)}
    assert set(trained) | set(gone) == everything and not set(trained) & set(gone)
    assert set(trained.values()) == {1} and set(gone.values()) == {1}
    assert book.trained == len(trained)


def test_a_checkpoint_of_the_first_format_still_loads_and_a_newer_one_is_refused_with_the_reason():
    old = {"next_epoch": 2, "pending": [[1, 2], [1, 0], [0, 3]], "trained": [[0, 0], [0, 1], [0, 2], [1, 1]],
           "filtered": [[1, 3], [0, 3]]}  # (0, 3) filtered and pending again: a duplicate, not leased
    book = ledger(n=4, epochs=2)
    book.restore(old)
    assert list(book.pending) == [(1, 2), (1, 0)] and book.trained == 4
    assert [k for k in [(e, p) for e in range(2) for p in range(4)] if not book.done(k)] == [(1, 0), (1, 2)]
    assert book.take(4, "g", lambda t: False) == [(1, 2), (1, 0)] and not book.take(1, "g", lambda t: False)
    with pytest.raises(ValueError, match="format 3: this learner reads formats 1 and 2"):
        ledger().restore({**book.snapshot(), "format": 3})
    with pytest.raises(ValueError, match="4 prompts shuffled with data.seed=0, this run has 6 .* the same data"):
        ledger(n=6).restore(book.snapshot())


def test_the_held_sum_kept_as_leases_change_equals_the_sum_made_afresh():
    """ledger.Holdings keeps sum over the active principals of min(r, held) as leases are granted, settled and taken
    back, made afresh only when the active set or r changes: at every point it equals the sum made from the leases."""
    import random

    rng = random.Random(0)
    book = ledger(n=400)
    principals = [f"p{i}" for i in range(12)]
    active, r, next_id = set(principals[:8]), 3, 1
    for _ in range(3000):
        action = rng.random()
        if action < 0.4:
            keys = book.take(rng.randint(1, 4), "x", lambda tried: False)
            if keys:
                book.grant(LeaseState(next_id, f"gen-{next_id % 20}", {k: P.PromptItem(k[1], k[0], "p") for k in keys},
                                      1.0, 0, 0.0, principal=rng.choice(principals)))
                next_id += 1
        elif action < 0.7 and book.leases:
            lease_ = rng.choice(list(book.leases.values()))
            book.settle(lease_.lease_id, next(iter(lease_.items)))
        elif action < 0.85 and book.leases:
            book.take_back(rng.choice(list(book.leases)))
        elif action < 0.95:
            active = set(rng.sample(principals, rng.randint(1, 12)))  # a new set: registered, left or drained
        else:
            r = rng.randint(1, 6)
        held = Counter()
        for le in book.leases.values():
            held[le.principal] += len(le.items)
        assert book.held.capped(active, r) == sum(min(r, h) for p, h in held.items() if p in active)


def test_a_batch_holds_back_only_for_leased_groups_whose_last_chance_it_is():
    """k = 1, a lease of version 0 still out: at step 1 a batch of newer groups would leave it to go stale, so there
    is none yet (and the ledger says how many it waits for). At step 2 the lease is past its last chance, no batch
    waits for it. A generator that had loaded version 1 when it took a lease of min_version 0 starts it at 1 (its
    `start`): that lease's last chance is step 2, not 1."""
    book = ledger(n=8)
    lease(book, 1, 2)  # min_version 0, started at 0
    later = lease(book, 2, 2)
    later.start = 1  # its generator held version 1 when it was granted
    for key in book.take(2, "g", lambda tried: False):
        book.buffered(group(key, 1))
    # lease 1's last chance is step 1, lease 2's step 2
    assert book.left_behind(1, 1, 2, newest=1) == 2 and book.left_behind(2, 1, 2, newest=2) == 2
    assert book.batch(step=1, k=1, size=2) == (None, 0, 2)
    batch, _, _ = book.batch(step=1, k=1, size=2, for_last_chance=False)  # waited long enough: take what there is
    assert len(batch) == 2 and book.counters["stale_dropped"] == 0
    book.finish_step()
    for key in book.take(2, "g", lambda tried: False):
        book.buffered(group(key, 2))
    book.settle(2, next(iter(later.items)))  # (one of lease 2's groups is no longer out)
    assert book.left_behind(2, 1, 2, newest=2) == 1  # lease 1 (version 0) is past its last chance at step 2
    assert book.batch(step=2, k=1, size=2)[0] is None  # held for lease 2's group
    assert staleness.last_chance(2, 1, 1) and not staleness.last_chance(2, 1, 0)



def test_a_batch_holds_back_for_old_groups_that_the_steps_left_before_their_last_could_not_all_take():
    """k = 2, batches of 2: three groups leased on version 0 are still out when three newer ones (version 1) are
    buffered. Taking two of those at step 1 would leave the three old ones to step 2 only (their last), which takes
    two: one would go stale. So the batch at step 1 waits, though its step is no group's last (a rule of last chances
    alone takes it). Once the old groups come, steps 1-3 train all six and drop none. Two engines beside the learner
    at k = 8 dropped 30 groups of version 1 this way in their first ten steps (docs/figures.md)."""
    book = ledger(n=8)
    old = lease(book, 1, 3)  # min_version 0, started at 0: trained by step 2 at the latest
    for key in book.take(3, "g", lambda tried: False):
        book.buffered(group(key, 1))
    assert not any(staleness.last_chance(1, 2, v) for v in (0, 1))  # no group's last chance is step 1
    assert book.left_behind(1, 2, 2, newest=1) == 3
    assert book.batch(step=1, k=2, size=2) == (None, 0, 3)
    for key in list(old.items):  # the old groups arrive
        book.settle(1, key)
        book.buffered(group(key, 0))
    trained = []
    for step in (1, 2, 3):
        batch, _, _ = book.batch(step=step, k=2, size=2)
        assert batch is not None
        trained += [staleness.behaviour_version(g) for g in batch]
        book.finish_step()
    assert book.counters["stale_dropped"] == 0 and trained == [0, 0, 0, 1, 1, 1]
