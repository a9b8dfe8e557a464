"""Where each learner step's time went, for its metrics.jsonl record and the trace (pipeline/trace.py).

A step is its phases, one after another, each a span on the learner's track and a number in the record:

    wait       for a batch of rollouts (time/wait_s)
      early    inside `wait`: proximal log-probs of the batch's first groups (time/early_s, not in time/wait_s)
    train      the step itself (time/step_s)
    publish    the new weights version sent on its way (time/publish_s)
    record     the step's metrics record
    checkpoint when one is due

and the step's own span (`step`) covers them all, so they add up to its wall time. The record also gets, from the
hub's figures (hub/trainer.py's HubStats), what the hub's thread spent since the last record (time/hub/<message>_s:
decode, rollout, lease_request, ...) and what the generators' stages gained (gen/<stage>_s, summed over generators,
from their heartbeats) since each one's first report after it registered: a generator counts its seconds from its own
start, and the time it spent building its engine is no step's (it made a generator that joined look idle for tens of
seconds in the step it joined).
"""

from __future__ import annotations

import time

from hub.trainer import HubStats
from pipeline import trace


class StepTimes:
    def __init__(self, hub: HubStats | None) -> None:
        """`hub`: rank 0's hub's figures at the start (its thread's busy seconds), None on other ranks."""
        self.hub_before: dict = dict(hub.busy) if hub is not None else {}
        self.gen_before: dict[str, dict] = {}
        self.begin()

    def begin(self) -> None:
        self.start = time.time()
        self.sums = trace.Sums()

    def phase(self, name: str):
        """A context manager: the time inside it is phase `name` of this step."""
        return trace.span(name, "learner", self.sums)

    def end(self, step: int, skipped: bool = False) -> None:
        """The step's span, around its phases; the next step begins now."""
        trace.complete("step (skipped)" if skipped else "step", "learner", self.start, time.time(), step=step)
        self.begin()

    def record(self, hub: HubStats | None) -> dict:
        """The step's phases so far, and from `hub` (rank 0's figures now; None: none) the hub's and the generators'
        seconds since the last record."""
        s = self.sums
        early = s.get("early", 0.0)  # inside `wait`: the learner's compute while it waited (learner/early.py)
        out = {"time/wait_s": s.get("wait", 0.0) - early, "time/step_s": s.get("train", 0.0),
               "time/publish_s": s.get("publish", 0.0)}
        if early:
            out["time/early_s"] = early
        if hub is None:
            return out
        busy = hub.busy
        out.update({f"time/hub/{k}_s": v for k, v in trace.gained(busy, self.hub_before).items()})
        self.hub_before = busy
        stages = hub.stages
        gained: dict[str, float] = {}
        for gen_id, now in stages.items():
            before = self.gen_before.get(gen_id)
            if not before:  # its first report since it registered counts from its start (its engine's build, its
                continue  # time before a reconnect): no step's; what it gains from there on is
            for k, v in trace.gained(now, before).items():
                gained[k] = gained.get(k, 0.0) + max(0.0, v)
        out.update({f"gen/{k}_s": v for k, v in sorted(gained.items())})
        self.gen_before = stages
        return out
