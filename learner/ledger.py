"""The prompt ledger: where every prompt of the run is, with no sockets and no threads (the hub holds its lock).

A prompt (epoch, prompt_id) lives in exactly one place: pending (a deque; epochs are appended in a seeded
shuffle as they are needed), a lease, the buffer of received groups, the step being trained, trained, or filtered
(trainer.dynamic_sampling: its group's rewards were all equal, so it is done for the epoch without a step).
Moving it is the ledger's job and nobody else's: grant and settle leases, take a lease back (expired, its
generator gone), buffer a group, hand a batch to the learner, finish or abandon that step. Faults are
remembered per prompt (engine attempts, and which principals failed it), so a prompt one generator fails is
offered to another first. `snapshot` / `restore` carry it across a checkpoint: what was leased or buffered
counts as pending.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from learner import staleness
from pipeline import protocol as P

Key = tuple[int, int]  # (epoch, prompt_id)


@dataclass
class LeaseState:
    lease_id: int
    generator_id: str
    items: dict[Key, P.PromptItem]  # not yet received
    temperature: float
    min_version: int
    granted: float  # time.monotonic()
    unreported: int = 0  # consecutive heartbeats of its generator that did not list it


class PromptLedger:
    def __init__(self, n_prompts: int, epochs: int, seed: int, counters: dict[str, int]):
        self.n_prompts, self.epochs, self.seed = n_prompts, epochs, seed
        self.counters = counters  # the hub's: requeued, stale_dropped, skipped_steps are counted here
        self.pending: deque[Key] = deque()
        self.leases: dict[int, LeaseState] = {}
        self.buffer: list[tuple[P.RolloutGroup, float]] = []  # (group, arrival time)
        self.in_step: list[P.RolloutGroup] = []
        self.trained: set[Key] = set()
        self.filtered: set[Key] = set()  # done for their epoch without a step (dynamic sampling)
        self.next_epoch = 0
        self.attempts: dict[Key, int] = {}  # engine failures per prompt
        self.failed_by: dict[Key, set[str]] = {}  # principals (keys, or ids) that failed the prompt, any kind

    # ---- pending ------------------------------------------------------------------------------------

    def take(self, n: int, principal: str, confirmed: Callable[[set[str]], bool]) -> list[Key]:
        """Up to n pending prompts (the next epoch is added when needed), leaving at the front those `principal`
        failed while another may still try them (`confirmed(failed_by)` is False)."""
        out, skipped = [], []
        while len(out) < n and (self.pending or self._refill()):
            key = self.pending.popleft()
            tried = self.failed_by.get(key)
            if self.done(key):
                continue
            if tried and principal in tried and not confirmed(tried):
                skipped.append(key)
                continue
            out.append(key)
        self.pending.extendleft(reversed(skipped))
        return out

    def _refill(self) -> bool:
        if self.epochs and self.next_epoch >= self.epochs:
            return False
        order = list(range(self.n_prompts))
        random.Random(self.seed * 1_000_003 + self.next_epoch).shuffle(order)
        self.pending.extend((self.next_epoch, pid) for pid in order)
        self.next_epoch += 1
        return True

    def requeue(self, keys: list[Key]) -> None:
        """Back to the front of the queue, in order: they are leased again first."""
        self.pending.extendleft(reversed(keys))
        self.counters["requeued"] += len(keys)

    # ---- leases -------------------------------------------------------------------------------------

    def grant(self, lease: LeaseState) -> None:
        self.leases[lease.lease_id] = lease

    def leases_of(self, generator_id: str) -> list[LeaseState]:
        return [lease for lease in self.leases.values() if lease.generator_id == generator_id]

    def settle(self, lease_id: int, key: Key) -> None:
        """A leased prompt's group arrived or failed: off its lease, and the lease off the books once empty."""
        lease = self.leases[lease_id]
        del lease.items[key]
        if not lease.items:
            del self.leases[lease_id]

    def take_back(self, lease_id: int) -> list[Key]:
        """A whole lease goes back to the front of the queue (expired, or its generator is gone)."""
        keys = list(self.leases.pop(lease_id).items)
        self.requeue(keys)
        return keys

    def take_back_all(self, generator_id: str) -> int:
        return sum(len(self.take_back(lease.lease_id)) for lease in self.leases_of(generator_id))

    # ---- faults -------------------------------------------------------------------------------------

    def failed(self, key: Key, principal: str) -> tuple[int, set[str]]:
        """A group of `key` failed in `principal`'s generator: (attempts so far, principals that failed it)."""
        self.attempts[key] = self.attempts.get(key, 0) + 1
        tried = self.failed_by.setdefault(key, set())
        tried.add(principal)
        return self.attempts[key], tried

    def forgive(self, key: Key) -> None:
        """The prompt is not at fault (or was rejected): anyone may take it again."""
        self.failed_by.pop(key, None)

    # ---- received groups and steps ------------------------------------------------------------------

    def buffered(self, group: P.RolloutGroup) -> None:
        self.buffer.append((group, time.monotonic()))

    def filter(self, group: P.RolloutGroup) -> None:
        """Its rewards were all equal (no signal, dynamic sampling): done for its epoch, a fresh group takes its
        place in the batch."""
        self.filtered.add((group.epoch, group.prompt_id))
        self.counters["filtered_groups"] = self.counters.get("filtered_groups", 0) + 1

    def done(self, key: Key) -> bool:
        return key in self.trained or key in self.filtered

    def is_buffered(self, key: Key) -> bool:
        return any((g.epoch, g.prompt_id) == key for g, _ in self.buffer) or any(
            (g.epoch, g.prompt_id) == key for g in self.in_step)

    def in_flight(self) -> int:
        """Groups leased, buffered or being trained: what admission bounds."""
        return sum(len(lease.items) for lease in self.leases.values()) + len(self.buffer) + len(self.in_step)

    def batch(self, step: int, k: int, size: int) -> tuple[list[P.RolloutGroup] | None, int]:
        """(a batch of `size` groups fresh enough for `step`, oldest first, or None; groups dropped as stale,
        their prompts leased again)."""
        fresh, stale = staleness.split_stale(self.buffer, step, k)
        if stale:
            self.buffer = fresh
            self.pending.extendleft(reversed([(g.epoch, g.prompt_id) for g, _ in stale]))
            self.counters["stale_dropped"] += len(stale)  # (not counted as re-queued)
        if len(self.buffer) < size:
            return None, len(stale)
        ordered = staleness.oldest_first(self.buffer)
        self.buffer = ordered[size:]
        self.in_step = [g for g, _ in ordered[:size]]
        return self.in_step, len(stale)

    def finish_step(self) -> None:
        self.trained.update((g.epoch, g.prompt_id) for g in self.in_step)
        self.in_step = []

    def abandon_step(self) -> None:
        """The step was skipped: its groups are not trained, their prompts are leased again."""
        self.requeue([(g.epoch, g.prompt_id) for g in self.in_step])
        self.counters["skipped_steps"] += 1
        self.in_step = []

    def exhausted(self) -> bool:
        """Every prompt of the last epoch is trained or gone, and nothing is out: no batch can come any more."""
        return bool(self.epochs) and self.next_epoch >= self.epochs and not self.leases and not self.in_step \
            and all(self.done(key) for key in self.pending)

    # ---- checkpoint state ---------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Taken between steps: leased and buffered prompts count as pending."""
        unfinished = [k for lease in self.leases.values() for k in lease.items]
        unfinished += [(g.epoch, g.prompt_id) for g, _ in self.buffer]
        return {"next_epoch": self.next_epoch, "pending": [list(k) for k in unfinished + list(self.pending)],
                "trained": sorted(list(k) for k in self.trained), "filtered": sorted(list(k) for k in self.filtered)}

    def restore(self, state: dict) -> None:
        self.next_epoch = state["next_epoch"]
        self.pending = deque(tuple(k) for k in state["pending"])
        self.trained = {tuple(k) for k in state["trained"]}
        self.filtered = {tuple(k) for k in state.get("filtered", [])}
