"""The prompt ledger and the staleness rules, without sockets or threads: every prompt is in exactly one place."""

from __future__ import annotations

from collections import Counter

from learner import staleness
from learner.ledger import LeaseState, PromptLedger
from pipeline import protocol as P

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


def places(book: PromptLedger) -> Counter:
    """How often each prompt of epoch 0 appears across the ledger's places (each must be exactly once)."""
    where = list(book.pending) + [k for le in book.leases.values() for k in le.items]
    where += [(g.epoch, g.prompt_id) for g, _ in book.buffer] + [(g.epoch, g.prompt_id) for g in book.in_step]
    where += list(book.trained) + list(book.filtered)
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
    batch, dropped = book.batch(step=0, k=0, size=2)
    assert len(batch) == 2 and dropped == 0 and book.in_step == batch
    book.abandon_step()  # not finite: leased again
    assert book.counters["skipped_steps"] == 1 and len(book.pending) == 5
    assert set(places(book).values()) == {1} and len(places(book)) == 6
    c = lease(book, 3, 5)
    for key in list(c.items):
        book.settle(3, key)
        book.buffered(group(key))
    batch, _ = book.batch(step=0, k=0, size=4)
    book.finish_step()
    assert len(book.trained) == 4 and set(places(book).values()) == {1} and len(places(book)) == 6


def test_stale_groups_are_dropped_and_leased_again_and_a_batch_takes_the_oldest_first():
    book = ledger()
    keys = list(lease(book, 1, 4).items)
    for key, version in zip(keys, (0, 2, 1, 2), strict=True):
        book.settle(1, key)
        book.buffered(group(key, version))
    batch, dropped = book.batch(step=2, k=1, size=2)  # lag of version 0 at step 2 is 2 > k
    assert dropped == 1 and book.pending[0] == keys[0] and book.counters["stale_dropped"] == 1
    assert [staleness.behaviour_version(g) for g in batch] == [1, 2]


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
    for i, k in enumerate(list(again.pending)):
        again.take(1, "g", lambda t: False)
        again.trained.add(k)
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
    batch, _ = book.batch(step=0, k=0, size=3)
    book.finish_step()
    again = ledger(n=4, epochs=1)
    again.restore(book.snapshot())
    assert again.filtered == {keys[0]} and again.exhausted()
    book.requeue([keys[0]])  # a late duplicate lease of it: skipped when taken
    assert book.take(4, "g", lambda t: False) == []
