"""The lease desk (`LeaseDesk`, the hub's `desk`), on the hub's state under its lock: which prompts a generator may
take now, and for how long.

Training's prompts come first: up to `room` prompts of the training ledger (pipeline/staleness.py: admission and the
lease's minimum version), each tokenised here (hub/prompts.py: a prompt no engine can take is rejected without asking
one). No principal (a key, or an id without keys) may take the room that every other registered one needs for a lease
of its own (`share`), so one peer cannot hold the whole window. An evaluation round's prompts (hub/evaluation.py:
outside admission) go first while the groups buffered beyond the learner's next batch hold as many samples as the
round has left (its engine time costs the learner nothing then: `ahead`), else to a generator when training has none
for it, at most generator.lease_size in flight per generator while training goes on; an overdue round takes turns
with training, training first. A lease goes back to the queue when it is not returned within hub.lease_timeout_s,
when its generator shows no progress for hub.progress_timeout_s (no tokens, no groups: a hung engine behind a live
heartbeat), or when its generator leaves it out of two heartbeats in a row (a lease the generator holds but the hub
does not is named in the reply, and dropped there); its late rollouts are dropped as unknown.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable

from hub.evaluation import Evaluation
from hub.faults import Faults
from hub.journal import Journal
from hub.ledger import Key, LeaseState, PromptLedger
from hub.prompts import Prompts
from hub.registry import GeneratorInfo, Registry
from hub.validation import Rejected
from pipeline import protocol as P
from pipeline import staleness
from pipeline.config import Config

log = logging.getLogger(__name__)

WAIT_S = 0.05  # how soon a generator told to wait for room asks again...
ASKS_PER_S = 1000  # ...unless the generators together would then ask more often than this


class LeaseDesk:
    """Built by the hub over its parts, called under its lock; the hub's version (trained) and whether the run is
    complete come with each call. It hands out lease ids, which never repeat across learner restarts (a late rollout
    for an old lease is recognised)."""

    def __init__(self, cfg: Config, ledger: PromptLedger, registry: Registry, evaluation: Evaluation, prompts: Prompts,
                 faults: Faults, journal: Journal, counters: dict, lock: threading.Condition,
                 sampling: Callable[[], P.Sampling]):
        self.cfg, self.ledger, self.registry, self.evaluation = cfg, ledger, registry, evaluation
        self.prompts, self.faults, self.journal, self.counters, self.lock = prompts, faults, journal, counters, lock
        self.sampling = sampling  # () -> the leases' P.Sampling, as the run-time knobs are now
        self.lease_ids = itertools.count(random.SystemRandom().randrange(1, 2**40) * 1000)

    def request(self, msg: P.LeaseRequest, gen: GeneratorInfo, version: int, complete: bool) -> P.Message:
        """Training's prompts first, unless the buffer feeds the learner through an evaluation round (`ahead`): then
        the round's first, so a round at a large k is sampled by weights near its version (at k = 8 a round labelled v10
        was sampled by versions 20-40 when it only took the window's gaps: docs/figures.md). Otherwise a round's in
        the time the window leaves (`evaluation_lease`); an overdue round takes turns with training, training first."""
        if complete:
            return P.RunComplete(version)
        n = min(msg.max_groups, self.cfg.generator.lease_size)
        if gen.stalled:  # its last leases were taken back for want of progress: it shows it runs with one group
            n = min(n, 1)
        evaluation = self.evaluation
        overdue = evaluation.overdue(version)
        ahead = self.ahead()
        if (ahead or overdue and evaluation.turn) and (
                lease := self.evaluation_lease(gen, n, ahead or overdue, version)) is not None:
            evaluation.turn = False
            return lease
        reply = self._training(gen, n, version)
        if isinstance(reply, P.Lease):
            evaluation.turn = True
            return reply
        return self.evaluation_lease(gen, n, overdue, version) or reply

    def ahead(self) -> bool:
        """Whether the groups buffered beyond the learner's next batch hold as many samples as the oldest round has
        left to lease: its engine time then costs the learner no wait (a round of 128 prompts x 4 samples beside a
        batch made it take 3.7 s where 1.4 s was the engine's own: docs/figures.md, "Every GPU busy")."""
        owed, t = self.evaluation.owed(), self.cfg.trainer
        return owed > 0 and (len(self.ledger.buffer) - t.batch_size) * t.group_size >= owed

    def evaluation_lease(self, gen: GeneratorInfo, n: int, uncapped: bool, version: int) -> P.Lease | None:
        """Up to n prompts of the oldest round; while training goes on, unless `uncapped` (the round is overdue, or
        the buffer is `ahead`), no more than generator.lease_size in flight for `gen`, so a round shares an
        engine with a batch the learner waits for only that much."""
        evaluation = self.evaluation
        if not uncapped and version < self.cfg.trainer.total_steps:
            n = min(n, self.cfg.generator.lease_size - evaluation.held(gen.generator_id))
        return evaluation.lease(next(self.lease_ids), gen.generator_id, n)

    def _training(self, gen: GeneratorInfo, n: int, version: int) -> P.Message:
        """Up to n prompts of the training ledger within admission and `gen`'s share, or why not (Wait, RunComplete)."""
        t = self.cfg.trainer
        if version >= t.total_steps:
            return P.Wait("the last evaluation", retry_s=0.5) if self.evaluation.busy() else P.RunComplete(version)
        in_flight = self.ledger.in_flight()
        room, why = staleness.room(version, in_flight, t.total_steps, t.batch_size, t.max_staleness)
        room = min(self.share(gen, room), n)
        if room <= 0:
            return P.Wait(why or "the rest of the window is kept for other generators", retry_s=self.retry_s())
        items = self._items(room, gen)
        if not items:
            return P.Wait("dataset exhausted", retry_s=0.5)
        min_version = staleness.min_version(version, in_flight, t.batch_size, t.max_staleness, len(items))
        sampling = self.sampling()
        lease = LeaseState(next(self.lease_ids), gen.generator_id, items, sampling.temperature, min_version,
                           time.monotonic(), principal=gen.principal, start=gen.applied)
        self.ledger.grant(lease)
        return P.Lease(lease.lease_id, min_version, list(items.values()), sampling=sampling)

    def retry_s(self) -> float:
        """When a generator told to wait for room in the window asks again: 50 ms, longer with many generators (1,024
        of them asking every 50 ms sent the hub 20,000 requests a second, which took its whole core:
        bench/hub_ceiling.py)."""
        return max(WAIT_S, len(self.registry.generators) / ASKS_PER_S)

    def share(self, gen: GeneratorInfo, room: int) -> int:
        """What `gen`'s principal may take of `room` free groups: what leaves every other registered principal (not
        draining) room for r groups beyond what it holds, r = generator.lease_size or its equal part of the window
        when that is smaller; and at least its own r. Work-conserving: a principal that holds its r does not hold
        back another, so a large engine beside a small one still fills the window."""
        t = self.cfg.trainer
        mine = gen.principal
        active = self.registry.active_principals()  # (kept between requests: this runs for every one)
        held = self.ledger.held  # by principal; a lease keeps the principal it was granted to
        principals = len(active) + (mine not in active)  # the others' and this one's
        r = max(1, min(self.cfg.generator.lease_size, (t.max_staleness + 1) * t.batch_size // principals))
        # each other principal's r less what it holds (kept as leases change: ledger.Holdings)
        own = held.by.get(mine, 0)
        others = (principals - 1) * r - (held.capped(active, r) - (min(r, own) if mine in active else 0))
        return max(min(room, r - own), room - others)

    def _items(self, n: int, gen: GeneratorInfo) -> dict[Key, P.PromptItem]:
        """Up to n prompts for `gen`, tokenised here (a rollout must echo these ids)."""
        items: dict[Key, P.PromptItem] = {}
        while len(items) < n:
            keys = self.ledger.take(n - len(items), gen.principal, self.registry.confirmed)
            if not keys:
                break
            for key in keys:
                try:
                    items[key] = self.prompts.item(*key)
                except Rejected as e:
                    self.faults.reject_prompt(key, "hub", e.detail)
        return items

    def reconcile(self, msg: P.Heartbeat, gen: GeneratorInfo) -> list[int]:
        """A heartbeat lists the leases its generator holds: ones it stopped listing go back to the queue; returns the
        ones it lists that the hub no longer holds for it (the generator drops their groups)."""
        held = set(msg.lease_ids)
        settled = gen.received >= msg.pushed  # every rollout it sent so far is here (PUSH/PULL keeps their order)
        mine = self.ledger.leases_of(gen.generator_id)
        for lease in mine:
            if lease.lease_id in held or not settled:
                lease.unreported = 0
                continue
            lease.unreported += 1
            if lease.unreported >= 2:  # two heartbeats in a row: not a heartbeat sent before the lease arrived
                self.expire(lease, "its generator no longer reports it")
        return sorted(held - {lease.lease_id for lease in mine} - self.evaluation.leases_of(gen.generator_id))

    def expire_old(self, now: float) -> None:
        """Leases not returned within self.lease_timeout_s, and those of generators that made no progress (no tokens
        reported, no group delivered or failed, no weights loaded) for self.progress_timeout_s since the lease was
        granted: at least 3 heartbeats, by which progress is reported."""
        timeout = self.cfg.hub.lease_timeout_s
        idle = max(self.cfg.hub.progress_timeout_s, 3 * self.cfg.hub.heartbeat_s)
        self.evaluation.take_back(older_than=timeout)
        for lease in list(self.ledger.leases.values()):  # oldest first (in the order granted)
            if now - lease.granted <= min(timeout, idle):  # neither check can hold for this one, or any after it
                break
            gen = self.registry.generators.get(lease.generator_id)
            if now - lease.granted > timeout:
                self.expire(lease, f"not returned within self.lease_timeout_s={timeout}")
            elif gen is not None and now - max(lease.granted, gen.progress_at) > idle:
                gen.stalled = True
                self.expire(lease, f"its generator made no progress (no tokens, no groups) for {idle:g} s "
                                   "(self.progress_timeout_s)")

    def expire(self, lease: LeaseState, why: str) -> None:
        """A lease goes back to the queue while its generator stays (its late rollouts are dropped as unknown)."""
        keys = self.ledger.take_back(lease.lease_id)
        self.counters["lost_leases"] += 1
        gen_id = lease.generator_id
        self.journal.event("lease_expired", self.registry.principal_of(gen_id), generator=gen_id,
                           lease=lease.lease_id, prompts=len(keys), reason=why)
        log.warning("hub: lease %d of %s re-queued (%d prompts): %s", lease.lease_id, gen_id, len(keys), why)
        self.lock.notify_all()
