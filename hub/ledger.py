"""The prompt ledger: where every prompt of the run is, with no sockets and no threads (the hub holds its lock).

A prompt (epoch, prompt_id) lives in exactly one place: pending (a deque; epochs are appended in a seeded
shuffle as they are needed), a lease, the buffer of received groups, the step being trained, or done for its
epoch: trained, filtered (trainer.dynamic_sampling: its group's rewards were all equal, so it is done without a
step) or rejected (no engine can take it). Moving it is the ledger's job and nobody else's: grant and settle
leases, take a lease back (expired, its generator gone), buffer a group, hand a batch to the learner, finish or
abandon that step. Faults are remembered per prompt (engine attempts, and which principals failed it), so a
prompt one generator fails is offered to another first. "Done" is kept as one flag per prompt for the epochs
that still have a prompt out, so the ledger holds about one epoch of keys however many epochs pass.
`snapshot` / `restore` carry it across a checkpoint: what was leased or buffered counts as pending, and the
state lists only what is not done (the untouched rest of an epoch by its length), the size of the staleness
window rather than of the dataset.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from pipeline import protocol as P
from pipeline import staleness

Key = tuple[int, int]  # (epoch, prompt_id)
STATE_FORMAT = 2  # of `snapshot`; `restore` reads 1 too (before issue 32: every key listed)


@dataclass
class LeaseState:
    lease_id: int
    generator_id: str
    items: dict[Key, P.PromptItem]  # not yet received
    temperature: float
    min_version: int
    granted: float  # time.monotonic()
    unreported: int = 0  # consecutive heartbeats of its generator that did not list it
    principal: str = ""  # its generator's (a key, or the id without keys); "" for generator_id
    start: int = -1  # the oldest version its groups can start from: min_version, or the version its generator had
    # loaded when it was granted if newer (an engine's weights only move forward); -1: min_version

    @property
    def behaviour(self) -> int:
        """The oldest behaviour version its groups can have (`start`)."""
        return max(self.min_version, self.start)


class Holdings:
    """Groups on leases by principal, and the sum over the active principals of min(r, what each holds), kept as
    leases change: each lease request's share reads it (hub/leases.py), and summing over a thousand holders for
    every request took the hub's core. The sum is made afresh only when the active principals (a new set from the
    registry) or r change: when a generator registers, leaves or drains."""

    def __init__(self) -> None:
        self.by: dict[str, int] = {}
        self._active: set[str] | None = None
        self._r = 0
        self._capped = 0

    def change(self, principal: str, n: int) -> None:
        old = self.by.get(principal, 0)
        if old + n:
            self.by[principal] = old + n
        else:
            self.by.pop(principal, None)
        if self._active is not None and principal in self._active:
            self._capped += min(self._r, old + n) - min(self._r, old)

    def capped(self, active: set[str], r: int) -> int:
        """The sum over `active` of min(r, held)."""
        if active is not self._active or r != self._r:
            self._active, self._r = active, r
            self._capped = sum(min(r, h) for p, h in self.by.items() if p in active)
        return self._capped


class PromptLedger:
    def __init__(self, n_prompts: int, epochs: int, seed: int, counters: dict[str, int]):
        self.n_prompts, self.epochs, self.seed = n_prompts, epochs, seed
        self.counters = counters  # the hub's: requeued, stale_dropped, skipped_steps are counted here
        self.pending: deque[Key] = deque()
        self.fresh = 0  # the last `fresh` keys of pending: the rest of epoch next_epoch - 1's shuffle, untouched
        self.leases: dict[int, LeaseState] = {}
        # groups on leases, in all and by principal, and the leases by generator: kept as leases change (admission,
        # each lease request's share and each heartbeat read them; walking the leases each time took the hub's core
        # with hundreds of generators)
        self.leased = 0
        self.held = Holdings()
        self._by_generator: dict[str, dict[int, LeaseState]] = {}
        self.buffer: list[staleness.Buffered] = []
        self.in_step: list[P.RolloutGroup] = []
        # done for its epoch (trained, filtered or rejected): one flag per prompt of each epoch that still has a
        # prompt not done, and how many those are; an epoch all done is forgotten (every key of it is done), so
        # the ledger holds about one epoch of keys however long the run
        self._done: dict[int, bytearray] = {}
        self._remaining: dict[int, int] = {}
        self.trained = 0  # groups trained in this run (across resumes)
        self.next_epoch = 0
        self.attempts: dict[Key, int] = {}  # engine failures per prompt
        self.failed_by: dict[Key, set[str]] = {}  # principals (keys, or ids) that failed the prompt, any kind

    # ---- pending ------------------------------------------------------------------------------------

    def take(self, n: int, principal: str, confirmed: Callable[[set[str]], bool]) -> list[Key]:
        """Up to n pending prompts (the next epoch is added when needed), leaving at the front those `principal`
        failed while another may still try them (`confirmed(failed_by)` is False)."""
        out: list[Key] = []
        skipped: list[Key] = []
        while len(out) < n and (self.pending or self._refill()):
            if len(self.pending) <= self.fresh:  # the front is the untouched rest of the epoch
                self.fresh -= 1
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
        epoch = self.next_epoch
        self.pending.extend((epoch, pid) for pid in self._order(epoch))
        self.fresh = len(self.pending)
        if self.n_prompts:
            self._done[epoch], self._remaining[epoch] = bytearray(self.n_prompts), self.n_prompts
        self.next_epoch += 1
        return True

    def _order(self, epoch: int) -> list[int]:
        """The epoch's prompt ids in its seeded shuffle (a checkpoint keeps where in it the run is, not the keys)."""
        order = list(range(self.n_prompts))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def requeue(self, keys: list[Key]) -> None:
        """Back to the front of the queue, in order: they are leased again first."""
        self.pending.extendleft(reversed(keys))
        self.counters["requeued"] += len(keys)

    # ---- leases -------------------------------------------------------------------------------------

    def grant(self, lease: LeaseState) -> None:
        lease.principal = lease.principal or lease.generator_id
        self.leases[lease.lease_id] = lease
        self._by_generator.setdefault(lease.generator_id, {})[lease.lease_id] = lease
        self._holds(lease, len(lease.items))

    def _holds(self, lease: LeaseState, change: int) -> None:
        self.leased += change
        self.held.change(lease.principal, change)

    def leases_of(self, generator_id: str) -> list[LeaseState]:
        return list(self._by_generator.get(generator_id, {}).values())

    def settle(self, lease_id: int, key: Key) -> None:
        """A leased prompt's group arrived or failed: off its lease, and the lease off the books once empty."""
        lease = self.leases[lease_id]
        del lease.items[key]
        self._holds(lease, -1)
        if not lease.items:
            self._drop(lease)

    def take_back(self, lease_id: int) -> list[Key]:
        """A whole lease goes back to the front of the queue (expired, or its generator is gone)."""
        lease = self.leases[lease_id]
        keys = list(lease.items)
        self._holds(lease, -len(keys))
        self._drop(lease)
        self.requeue(keys)
        return keys

    def _drop(self, lease: LeaseState) -> None:
        del self.leases[lease.lease_id]
        mine = self._by_generator[lease.generator_id]
        del mine[lease.lease_id]
        if not mine:
            del self._by_generator[lease.generator_id]

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

    def reject(self, key: Key) -> None:
        """No engine can take the prompt: done for its epoch without a group (hub/faults.py counts it)."""
        self._finish(key)

    # ---- received groups and steps ------------------------------------------------------------------

    def buffered(self, group: P.RolloutGroup) -> None:
        self.buffer.append(staleness.Buffered.of(group, time.monotonic()))

    def filter(self, group: P.RolloutGroup) -> None:
        """Its rewards were all equal (no signal, dynamic sampling): done for its epoch, a fresh group takes its
        place in the batch."""
        self._finish((group.epoch, group.prompt_id))
        self.counters["filtered_groups"] = self.counters.get("filtered_groups", 0) + 1

    def done(self, key: Key) -> bool:
        """Trained, filtered or rejected in its epoch (any key a peer names may be asked about)."""
        epoch, pid = key
        if not (0 <= epoch < self.next_epoch and 0 <= pid < self.n_prompts):
            return False
        flags = self._done.get(epoch)
        return flags is None or flags[pid] == 1  # an epoch no longer kept is done, all of it

    def _finish(self, key: Key) -> None:
        if self.done(key) or key[0] not in self._done:
            return
        epoch, pid = key
        self._done[epoch][pid] = 1
        self._remaining[epoch] -= 1
        if not self._remaining[epoch]:  # the whole epoch is done: its flags are no longer needed
            del self._done[epoch], self._remaining[epoch]
        self.attempts.pop(key, None)
        self.failed_by.pop(key, None)

    def is_buffered(self, key: Key) -> bool:
        return any((g.epoch, g.prompt_id) == key for g, *_ in self.buffer) or any(
            (g.epoch, g.prompt_id) == key for g in self.in_step)

    def in_flight(self) -> int:
        """Groups leased, buffered or being trained: what admission bounds."""
        return self.leased + len(self.buffer) + len(self.in_step)

    def batch(self, step: int, k: int, size: int, for_last_chance: bool = True,
              heard: Callable[[str], bool] = lambda generator_id: True) -> tuple[list[P.RolloutGroup] | None, int, int]:
        """(a batch of `size` groups fresh enough for `step`, oldest first, or None; groups dropped as stale,
        their prompts leased again; groups still out that the batch waits for: with `for_last_chance` it is None
        while taking newer groups would leave them with no step to train them (`left_behind`); only groups of
        generators `heard` lately count)."""
        keep, stale = staleness.split_stale(self.buffer, step, k)
        if stale:
            self.buffer = keep
            self.pending.extendleft(reversed([(g.epoch, g.prompt_id) for g, *_ in stale]))
            self.counters["stale_dropped"] += len(stale)  # (not counted as re-queued)
        if len(self.buffer) < size:
            return None, len(stale), 0
        ordered = staleness.oldest_first(self.buffer)
        # the leases are walked only when the batch would take a group that could wait
        out = self.left_behind(step, k, size, ordered[size - 1].behaviour, heard) if for_last_chance and \
            staleness.takes_a_newer_group(ordered, size, step, k) else 0
        if out:
            return None, len(stale), out
        self.buffer = ordered[size:]
        self.in_step = [g for g, *_ in ordered[:size]]
        return self.in_step, len(stale), 0

    def ahead(self, step: int, k: int, size: int) -> list[P.RolloutGroup]:
        """The buffered groups a batch for `step` would take first as the buffer stands: fresh enough for it, oldest
        first, up to `size`. Nothing moves (learner/early.py reads them while the learner waits for the rest)."""
        fresh, _ = staleness.split_stale(self.buffer, step, k)
        return [g for g, *_ in staleness.oldest_first(fresh)[:size]]

    def left_behind(self, step: int, k: int, size: int, newest: int,
                    heard: Callable[[str], bool] = lambda generator_id: True) -> int:
        """Groups on leases of generators `heard` lately that a batch for `step` taking groups up to behaviour
        `newest` would leave with no step to train them (`staleness.left_behind`)."""
        out: Counter[int] = Counter()
        for lease in self.leases.values():
            if heard(lease.generator_id):
                out[lease.behaviour] += len(lease.items)
        return staleness.left_behind(out, newest, step, k, size)

    def finish_step(self) -> None:
        for g in self.in_step:
            self._finish((g.epoch, g.prompt_id))
        self.trained += len(self.in_step)
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
        """Taken between steps: leased and buffered prompts count as pending. Everything not done is listed, ahead
        of the untouched rest of the current epoch (only its length: the seeded shuffle gives it back); every
        other key of an epoch begun is done. So the state is about the size of the staleness window, not of an
        epoch: it is taken under the hub's lock, and the learner's thread writes it as JSON, holding Python's GIL."""
        out = [k for lease in self.leases.values() for k in lease.items]
        out += [(g.epoch, g.prompt_id) for g, *_ in self.buffer] + [(g.epoch, g.prompt_id) for g in self.in_step]
        out += itertools.islice(self.pending, len(self.pending) - self.fresh)
        listed = [list(k) for k in dict.fromkeys(out) if not self.done(k)]  # each once, in order
        return {"format": STATE_FORMAT, "prompts": self.n_prompts, "seed": self.seed, "next_epoch": self.next_epoch,
                "pending": listed, "fresh": self.fresh, "trained_groups": self.trained}

    def restore(self, state: dict) -> None:
        """Load a snapshot: this format, or the first (every key listed: pending, trained, filtered)."""
        fmt = state.get("format", 1)
        if fmt not in (1, STATE_FORMAT):
            raise ValueError(f"hub state format {fmt}: this learner reads formats 1 and {STATE_FORMAT} (a checkpoint "
                             "of a newer release)")
        if fmt == STATE_FORMAT and (state["prompts"], state["seed"]) != (self.n_prompts, self.seed):
            raise ValueError(f"the checkpoint was taken over {state['prompts']} prompts shuffled with data.seed="
                             f"{state['seed']}, this run has {self.n_prompts} with data.seed={self.seed}: resume with "
                             "the same data")
        self.next_epoch = state["next_epoch"]
        done = {tuple(k) for k in state.get("filtered", [])} | (
            {tuple(k) for k in state["trained"]} if fmt == 1 else set())
        listed = list(dict.fromkeys(k for k in map(tuple, state["pending"]) if k not in done))
        self.fresh = state.get("fresh", 0)
        tail = self._order(self.next_epoch - 1)[self.n_prompts - self.fresh:] if self.fresh else []
        self.pending = deque(listed + [(self.next_epoch - 1, pid) for pid in tail])
        self.trained = len(state["trained"]) if fmt == 1 else state["trained_groups"]
        # every key of an epoch begun that is not pending is done: flags for the epochs with keys still pending
        self._done, self._remaining = {}, {}
        for epoch, pid in self.pending:
            flags = self._done.get(epoch)
            if flags is None:
                flags = self._done[epoch] = bytearray(b"\x01") * self.n_prompts
                self._remaining[epoch] = 0
            if flags[pid]:
                flags[pid] = 0
                self._remaining[epoch] += 1
