"""Where a generator's time goes: its seconds per stage (protocol.STAGES), which its heartbeats report and the learner
records per step (gen/<stage>_s), and its tracks on a profiled run's timeline (pipeline/trace.py).

The generator (generator/service.py) times its stages with `span`; each group runs in a `lane` (a track of the
timeline, the lowest one free) and says when its rollout starts and ends (`rollouts`): the time with any group in
its rollout is `generating`, the rest `idle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pipeline import trace


class Stages:
    def __init__(self):
        self.sums = trace.Sums()  # seconds per stage, `generating` as of the last rollout that ended
        self.started = time.monotonic()
        self.generating = 0  # groups in their rollout now: the engine has work while any is
        self.generating_since = 0.0
        self.lanes: set[int] = set()  # the timeline's group lanes in use

    def span(self, name: str, track: str, **args):
        """A context manager: the time inside it is stage `name`, and an event on `track` of the timeline."""
        return trace.span(name, track, self.sums, **args)

    def add(self, name: str, start: float, end: float, track: str) -> None:
        """Stage `name` ran from `start` to `end` (seconds of `time.time`; timed in another thread)."""
        self.sums.add(name, end - start)
        trace.complete(name, track, start, end)

    def report(self) -> dict[str, float]:
        """Seconds per stage since it started; `generating`: with a group in its rollout, `idle`: with none."""
        now = time.monotonic()
        generating = self.sums.get("generating", 0.0) + (now - self.generating_since if self.generating else 0.0)
        return {**self.sums, "generating": generating, "idle": max(0.0, now - self.started - generating)}

    def rollouts(self, change: int) -> None:
        """A group's rollout starts (+1) or ends (-1)."""
        now = time.monotonic()
        if change < 0 and self.generating == 1:
            self.sums.add("generating", now - self.generating_since)
        elif not self.generating:
            self.generating_since = now
        self.generating += change
        trace.counter("groups generating", groups=self.generating)

    @contextlib.contextmanager
    def lane(self):
        """The timeline's track of one group, the lowest one free while it runs."""
        lane = min(set(range(len(self.lanes) + 1)) - self.lanes)
        self.lanes.add(lane)
        try:
            yield f"group {lane}"
        finally:
            self.lanes.discard(lane)

    async def loop_lag(self, every_s: float = 0.05) -> None:
        """Profiled: how late the event loop wakes (vLLM's outputs, our Python and collections hold it)."""
        while True:
            start = time.monotonic()
            await asyncio.sleep(every_s)
            trace.counter("event loop lag", ms=(time.monotonic() - start - every_s) * 1000)
