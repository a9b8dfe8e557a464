"""The staleness rules, in one place: the hub's admission and leases, and the learner step's filter.

A group's behaviour version is the oldest weights version any of its tokens came from. The step turning
version v into v + 1 trains only groups with v - behaviour <= k (`trainer.max_staleness`). Admission keeps
the groups in flight (leased + buffered + in the step being trained) at most (k + 1) x batch_size, so
generation runs at most k versions ahead of training; a lease says the oldest version its groups may
start from (`min_version`, for its last group: every group of it started at or after that version is within k
when trained), which the generator waits for before generating. A batch waits a while for groups still out that
taking newer groups in their place would leave with no step to train them (`left_behind`), rather than drop them stale
after.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from pipeline import protocol as P


def behaviour_version(group: P.RolloutGroup) -> int:
    return min(s.first_version for s in group.samples)


class Buffered(NamedTuple):
    """A group waiting for its step, with what orders it: its behaviour version (found once: the learner's thread
    goes through the whole buffer, under the hub's lock, whenever it looks for a batch) and its arrival time."""

    group: P.RolloutGroup
    arrival: float
    behaviour: int

    @classmethod
    def of(cls, group: P.RolloutGroup, arrival: float) -> Buffered:
        return cls(group, arrival, behaviour_version(group))


def lag(group: P.RolloutGroup, step: int) -> int:
    return step - behaviour_version(group)


def room(version: int, in_flight: int, total_steps: int, batch_size: int, k: int) -> tuple[int, str]:
    """Groups that may be leased now, and why none may (when 0)."""
    still_needed = (total_steps - version) * batch_size - in_flight
    free = min((k + 1) * batch_size - in_flight, still_needed)
    if free > 0:
        return free, ""
    return 0, "waiting for the last steps" if still_needed <= 0 else "staleness window full"


def min_version(version: int, in_flight: int, batch_size: int, k: int, n: int = 1) -> int:
    """The oldest weights a new lease's `n` groups may start from: the last of them is trained at step
    version + (in_flight + n - 1) // batch_size at the latest, and must then lag at most k (a lease that straddles a
    batch boundary: its later groups are trained a step after its first)."""
    return min(version, max(0, version + (in_flight + n - 1) // batch_size - k))


def split_stale(buffered: list[Buffered], step: int, k: int) -> tuple[list[Buffered], list[Buffered]]:
    """(fresh, stale) buffered groups for the step turning version `step` into step + 1."""
    fresh = [b for b in buffered if step - b.behaviour <= k]
    stale = [b for b in buffered if step - b.behaviour > k]
    return fresh, stale


def last_chance(step: int, k: int, behaviour: int) -> bool:
    """Whether the step turning version `step` into step + 1 is the last that may train a group of `behaviour` (not
    one past it: no step may train that any more, and no batch waits for it)."""
    return step - behaviour == k


def takes_a_newer_group(ordered: list[Buffered], size: int, step: int, k: int) -> bool:
    """Whether a batch of the first `size` of `ordered` (oldest first) takes a group that could wait a step more. While
    groups whose last chance this step is are still being generated, it would leave them to go stale behind it, and
    they are the slowest, those with the longest completions (taking the batch anyway left 3-8 % of the groups stale
    at k = 1 and 2 on the shipped smollm2 config, with twice the tokens of the average group: docs/figures.md)."""
    return not last_chance(step, k, ordered[size - 1].behaviour)


def left_behind(out: Counter[int], newest: int, step: int, k: int, size: int) -> int:
    """Groups still out (`out`: how many by the oldest behaviour version each can have) that a batch of `size` for
    `step` taking groups up to behaviour `newest` leaves with no step to train them (0: none). Such a batch holds every
    buffered group older than `newest` (`oldest_first`), so for each behaviour b below `newest` the groups of b or older
    still out must fit the steps after this one up to b's last (b + k), `size` a step. The first b where they do not
    gives them all: the batch waits for them. At b's last step that room is none, so any group out whose last chance
    this step is holds it (`last_chance`). The room also runs out at earlier steps where groups leased on old weights
    arrive after newer ones: two engines beside the learner at k = 8 left 30 groups of version 1 that the steps up to
    9 could not all take (docs/figures.md, "Two engines beside the learner")."""
    held = 0
    for b in sorted(out):
        if b >= newest:
            break
        if b < step - k:  # past its last step already: no batch can take it
            continue
        held += out[b]
        if held > (b + k - step) * size:
            return held
    return 0


def oldest_first(buffered: list[Buffered]) -> list[Buffered]:
    """A batch takes the oldest groups first (by behaviour version, then arrival), before they go stale."""
    return sorted(buffered, key=lambda b: (b.behaviour, b.arrival))
