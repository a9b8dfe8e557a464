"""The lease desk, on the hub's state under its lock: which prompts a generator may take now, and for how long.

Training's prompts come first: up to `room` prompts of the training ledger (pipeline/staleness.py: admission and the
lease's minimum version), each tokenised here (hub/prompts.py: a prompt no engine can take is rejected without
asking one). No principal (a key, or an id without keys) may take the room that every other registered one needs for
a lease of its own (`share`), so one peer cannot hold the whole window. An evaluation round's prompts
(hub/evaluation.py: outside admission) go to a generator when training has none for it, at most
generator.lease_size in flight per generator while training goes on; an overdue round takes turns with training,
training first. A lease goes back to the queue when it is not returned within hub.lease_timeout_s, when its
generator shows no progress for hub.progress_timeout_s (no tokens, no groups: a hung engine behind a live
heartbeat), or when its generator leaves it out of two heartbeats in a row (a lease the generator holds but the hub
does not is named in the reply, and dropped there); its late rollouts are dropped as unknown.
"""

from __future__ import annotations

import logging
import time

from hub.ledger import Key, LeaseState
from hub.registry import GeneratorInfo
from hub.validation import Rejected
from pipeline import protocol as P
from pipeline import staleness

log = logging.getLogger(__name__)


def request(hub, msg: P.LeaseRequest, gen: GeneratorInfo) -> P.Message:
    """Training's prompts first; an evaluation round's in the time the window leaves (`evaluation_lease`). An overdue
    round takes turns with training, training first."""
    if hub.complete:
        return P.RunComplete(hub.version)
    n = min(msg.max_groups, hub.cfg.generator.lease_size)
    if gen.stalled:  # its last leases were taken back for want of progress: it shows it runs with one group
        n = min(n, 1)
    evaluation = hub.evaluation
    overdue = evaluation.overdue(hub.version)
    if overdue and evaluation.turn and (lease := evaluation_lease(hub, gen, n, overdue)) is not None:
        evaluation.turn = False
        return lease
    reply = _training(hub, gen, n)
    if isinstance(reply, P.Lease):
        evaluation.turn = True
        return reply
    return evaluation_lease(hub, gen, n, overdue) or reply


def evaluation_lease(hub, gen: GeneratorInfo, n: int, overdue: bool) -> P.Lease | None:
    """Up to n prompts of the oldest round; while training goes on and the round is not overdue, no more than
    generator.lease_size in flight for `gen`, so a round shares an engine with a batch only that much."""
    evaluation = hub.evaluation
    if not overdue and hub.version < hub.cfg.trainer.total_steps:
        n = min(n, hub.cfg.generator.lease_size - evaluation.held(gen.generator_id))
    return evaluation.lease(next(hub.lease_ids), gen.generator_id, n)


def _training(hub, gen: GeneratorInfo, n: int) -> P.Message:
    """Up to n prompts of the training ledger within admission and `gen`'s share, or why not (Wait, RunComplete)."""
    t = hub.cfg.trainer
    if hub.version >= t.total_steps:
        return P.Wait("the last evaluation", retry_s=0.5) if hub.evaluation.busy() else P.RunComplete(hub.version)
    in_flight = hub.ledger.in_flight()
    room, why = staleness.room(hub.version, in_flight, t.total_steps, t.batch_size, t.max_staleness)
    room = min(share(hub, gen, room), n)
    if room <= 0:
        return P.Wait(why or "the rest of the window is kept for other generators", retry_s=retry_s(hub))
    items = _items(hub, room, gen)
    if not items:
        return P.Wait("dataset exhausted", retry_s=0.5)
    min_version = staleness.min_version(hub.version, in_flight, t.batch_size, t.max_staleness, len(items))
    sampling = hub.sampling()
    lease = LeaseState(next(hub.lease_ids), gen.generator_id, items, sampling.temperature, min_version,
                       time.monotonic(), principal=gen.principal)
    hub.ledger.grant(lease)
    return P.Lease(lease.lease_id, min_version, list(items.values()), sampling=sampling)


WAIT_S = 0.05  # how soon a generator told to wait for room asks again...
ASKS_PER_S = 1000  # ...unless the generators together would then ask more often than this


def retry_s(hub) -> float:
    """When a generator told to wait for room in the window asks again: 50 ms, longer with many generators (1,024
    of them asking every 50 ms sent the hub 20,000 requests a second, which took its whole core:
    bench/hub_ceiling.py)."""
    return max(WAIT_S, len(hub.registry.generators) / ASKS_PER_S)


def share(hub, gen: GeneratorInfo, room: int) -> int:
    """What `gen`'s principal may take of `room` free groups: what leaves every other registered principal (not
    draining) room for r groups beyond what it holds, r = generator.lease_size or its equal part of the window
    when that is smaller; and at least its own r. Work-conserving: a principal that holds its r does not hold
    back another, so a large engine beside a small one still fills the window."""
    t = hub.cfg.trainer
    mine = gen.principal
    active = hub.registry.active_principals()  # (kept between requests: this runs for every one)
    held = hub.ledger.held  # by principal; a lease keeps the principal it was granted to
    principals = len(active) + (mine not in active)  # the others' and this one's
    r = max(1, min(hub.cfg.generator.lease_size, (t.max_staleness + 1) * t.batch_size // principals))
    # each other principal's r less what it holds (kept as leases change: ledger.Holdings)
    own = held.by.get(mine, 0)
    others = (principals - 1) * r - (held.capped(active, r) - (min(r, own) if mine in active else 0))
    return max(min(room, r - own), room - others)


def _items(hub, n: int, gen: GeneratorInfo) -> dict[Key, P.PromptItem]:
    """Up to n prompts for `gen`, tokenised here (a rollout must echo these ids)."""
    items: dict[Key, P.PromptItem] = {}
    while len(items) < n:
        keys = hub.ledger.take(n - len(items), gen.principal, hub.registry.confirmed)
        if not keys:
            break
        for key in keys:
            try:
                items[key] = hub.prompts.item(*key)
            except Rejected as e:
                hub.faults.reject_prompt(key, "hub", e.detail)
    return items


def reconcile(hub, msg: P.Heartbeat, gen: GeneratorInfo) -> list[int]:
    """A heartbeat lists the leases its generator holds: ones it stopped listing go back to the queue; returns the
    ones it lists that the hub no longer holds for it (the generator drops their groups)."""
    held = set(msg.lease_ids)
    settled = gen.received >= msg.pushed  # every rollout it sent so far is here (PUSH/PULL keeps their order)
    mine = hub.ledger.leases_of(gen.generator_id)
    for lease in mine:
        if lease.lease_id in held or not settled:
            lease.unreported = 0
            continue
        lease.unreported += 1
        if lease.unreported >= 2:  # two heartbeats in a row: not a heartbeat sent before the lease arrived
            expire(hub, lease, "its generator no longer reports it")
    return sorted(held - {lease.lease_id for lease in mine} - hub.evaluation.leases_of(gen.generator_id))


def expire_old(hub, now: float) -> None:
    """Leases not returned within hub.lease_timeout_s, and those of generators that made no progress (no tokens
    reported, no group delivered or failed, no weights loaded) for hub.progress_timeout_s since the lease was
    granted: at least 3 heartbeats, by which progress is reported."""
    timeout = hub.cfg.hub.lease_timeout_s
    idle = max(hub.cfg.hub.progress_timeout_s, 3 * hub.cfg.hub.heartbeat_s)
    hub.evaluation.take_back(older_than=timeout)
    for lease in list(hub.ledger.leases.values()):  # oldest first (in the order granted)
        if now - lease.granted <= min(timeout, idle):  # neither check can hold for this one, or any after it
            break
        gen = hub.registry.generators.get(lease.generator_id)
        if now - lease.granted > timeout:
            expire(hub, lease, f"not returned within hub.lease_timeout_s={timeout}")
        elif gen is not None and now - max(lease.granted, gen.progress_at) > idle:
            gen.stalled = True
            expire(hub, lease, f"its generator made no progress (no tokens, no groups) for {idle:g} s "
                               "(hub.progress_timeout_s)")


def expire(hub, lease: LeaseState, why: str) -> None:
    """A lease goes back to the queue while its generator stays (its late rollouts are dropped as unknown)."""
    keys = hub.ledger.take_back(lease.lease_id)
    hub.counters["lost_leases"] += 1
    hub.journal.event("lease_expired", hub.registry.principal_of(lease.generator_id), generator=lease.generator_id,
                      lease=lease.lease_id, prompts=len(keys), reason=why)
    log.warning("hub: lease %d of %s re-queued (%d prompts): %s", lease.lease_id, lease.generator_id, len(keys), why)
    hub.lock.notify_all()
