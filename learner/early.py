"""Proximal log-probs computed while the learner waits for the rest of its batch (trainer.early_proximal).

A step whose loss measures its updates against the proximal policy (trainer.loss m2po, or trainer.minibatches > 1)
begins with a no-grad forward over its rows: their log-probs under the weights the step starts from. Those weights are
in place once the step before has published, while the learner still waits for its batch's last groups, the longest
completions (at k = 1 it waited 16-37 % of the run on the shipped smollm2 config). So while it waits, it computes the
rows of the buffered groups that the batch would take first (`TrainerHub.ahead`), a micro-batch at a time (a full one,
or what waits once no group has come for QUIET_S), and the step computes only the rest (learner/step.py `proximal`).

A row's proximal log-probs depend on its prompt, its completion, its temperature and the weights, nothing else: they
are kept by that content for the step they were computed at, and dropped when the next step begins (a skipped step
keeps its weights, and them). A group computed ahead that a later batch takes is computed again there. Nothing the step
trains changes but the grouping of rows into micro-batches for that forward.

With several learner ranks, rank 0 alone hears the hub: at each look it sends the other ranks the groups new to them
and whether none has come for QUIET_S (`news`, learner/service.py `share_news`), and every rank takes them in the same
order (`take`), so all choose the same micro-batch and share its forward as the step does (`proximal`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from learner.batching import Row, build_rows, micro_batches
from learner.loss import Loss
from learner.step import proximal
from pipeline import protocol as P
from pipeline.config import Config

EARLY_TOKENS = 16384  # the largest micro-batch computed ahead (trainer.micro_batch_tokens 0 may size the step's larger)
POLL_S = 0.05  # seconds; how long the learner waits for its batch between looks at what it could compute ahead
QUIET_S = 0.05  # seconds without a new group, after which a micro-batch that is not full is computed all the same


def early_proximal(engine, cfg: Config, pad_id: int) -> EarlyProximal | None:
    """The strategy, picked once: None where the step computes no proximal log-probs, or with
    trainer.early_proximal false."""
    t = cfg.trainer
    needed = Loss.of(t).needs_proximal or t.minibatches > 1
    return EarlyProximal(engine, cfg, pad_id) if t.early_proximal and needed else None


def row_key(row: Row) -> tuple[float, bytes, bytes]:
    """What a row's proximal log-probs are a function of, besides the weights."""
    return row.temperature, row.prompt.tobytes(), row.completion.tobytes()


class EarlyProximal:
    def __init__(self, engine, cfg: Config, pad_id: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.cfg, self.pad_id, self.clock = engine, cfg, pad_id, clock
        self.begin(-1)

    def begin(self, step: int) -> None:
        """What was computed at an earlier step's weights is of no use at this one's."""
        self.step = step
        self.done: dict[tuple, np.ndarray] = {}  # row_key -> proximal log-probs at this step's weights
        self.seen: list[P.RolloutGroup] = []  # groups whose rows are computed or waiting (held: their ids stay theirs)
        self.ids: set[int] = set()
        self.waiting: list[Row] = []
        self.arrived = self.clock()  # when the last new group was seen

    def news(self, groups: list[P.RolloutGroup], step: int) -> tuple[list[P.RolloutGroup], bool]:
        """Rank 0, from the batch's first groups as buffered now: (those not seen yet, whether none has come for
        QUIET_S), what every rank's `take` is given."""
        if step != self.step:
            self.begin(step)
        new = [g for g in groups if id(g) not in self.ids]
        if new:
            self.arrived = self.clock()
        return new, not new and self.clock() - self.arrived >= QUIET_S

    def take(self, new: list[P.RolloutGroup], quiet: bool, step: int, budget: int) -> bool:
        """Every rank, with rank 0's news: take in the rows of `new` and compute one micro-batch of those waiting: a
        full one, or when `quiet` whatever waits (the learner has nothing else to do: the groups still out are the
        batch's longest). False when it computed none. The ranks hold the same rows in the same order, so they
        choose the same micro-batch and proximal()'s collectives line up."""
        if step != self.step:
            self.begin(step)
        if new:
            t = self.cfg.trainer
            rows, _ = build_rows(new, step, t.scale_rewards, (self.cfg.sampling.max_tokens, t.overlong_buffer,
                                                            t.overlong_penalty))
            self.seen += new
            self.ids.update(id(g) for g in new)
            self.waiting += [r for r in rows if row_key(r) not in self.done]
        size = min(budget, EARLY_TOKENS)
        batches = micro_batches(self.waiting, size)
        if not batches or len(batches) == 1 and not quiet:  # more rows may join it
            return False
        first = batches[0]
        proximal(self.engine, first, size, self.pad_id, first, self.seen)
        for r in first:
            assert r.prox is not None  # proximal set it
            self.done[row_key(r)] = r.prox
        computed = {id(r) for r in first}
        self.waiting = [r for r in self.waiting if id(r) not in computed]
        return True

    def fill(self, rows: list[Row], step: int) -> int:
        """Set the proximal log-probs of the rows computed ahead at this step's weights; returns how many."""
        if step != self.step:
            return 0
        n = 0
        for r in rows:
            prox = self.done.get(row_key(r))
            if prox is not None:
                r.prox, n = prox.copy(), n + 1
        return n
