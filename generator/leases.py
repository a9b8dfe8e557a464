"""The lease loop of one session: ask the hub for prompt groups while the engine has room, one task per group.

    LeaseRequest(room) -> Lease          once the engine holds the lease's min_version of this run, a task per prompt
                                         group (its generator's `group`); not started when a drain began
                       -> Wait           again after retry_s, or as soon as the engine loads a new version
                       -> RunComplete    drop the groups in flight, take the final weights, end
How many groups it keeps in flight: `inflight_cap` and `first_wave`. The generator (generator/service.py) builds one
per session (generator/session.py); it reads and sets its generator's `stopping` (`Owner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

from generator.session import Session
from generator.stages import Stages
from pipeline import protocol as P
from pipeline.config import Config

log = logging.getLogger(__name__)


FIRST_WAVE_QUARTERS = 5  # the first wave, in quarters of a batch (`first_wave`)


class Owner(Protocol):
    """What the lease loop uses of its generator (generator/service.py)."""

    id: str
    stopping: int  # 0: running; 1: draining, or the run is complete (the lease loop heard it); 2: leaving now
    draining: asyncio.Event  # a signal began the drain: no lease starts any more
    stages: Stages

    @property
    def cfg(self) -> Config: ...

    def group(self, session: Session, lease: P.Lease, item: P.PromptItem) -> Coroutine[Any, Any, None]:
        """One prompt group, generated and sent."""
        ...


def inflight_cap(cfg: Config, engine: Any, group_size: int) -> int:
    """generator.max_inflight_groups, or (0) what the engine runs at once in groups, plus one lease waiting."""
    if cfg.generator.max_inflight_groups:
        return cfg.generator.max_inflight_groups
    seqs = engine.concurrent_sequences()
    return -(-seqs // max(1, group_size)) + cfg.generator.lease_size


def first_wave(cfg: Config, cap: int) -> tuple[int, int]:
    """(a batch in groups, the first wave): until a batch's worth of its groups have ended, a generator keeps no
    more than 5/4 of a batch in flight (FIRST_WAVE_QUARTERS). The learner's first step waits for one batch, and an
    engine finishes a batch sooner among fewer sequences: on one H200 with configs/gpu-smollm2-math.yaml the first
    batch came 1.8 s after registration with 40 groups in flight against 3.7-6.1 s with 132 (docs/figures.md,
    "The first wave"). Once they have ended it fills its engine, long before the first step is trained."""
    batch = max(1, cfg.trainer.batch_size)
    return batch, min(cap, -(-batch * FIRST_WAVE_QUARTERS // 4))


class LeaseLoop:
    def __init__(self, owner: Owner, session: Session):
        self.owner, self.session = owner, session

    async def run(self) -> None:
        """Until the generator stops (a drain, the run complete), then until the groups in flight have ended."""
        gen, session = self.owner, self.session
        room = asyncio.Event()
        ended = 0  # groups sent, failed or cancelled

        def settled(task: asyncio.Task) -> None:  # a group ended: its lease may be done, and there is room
            nonlocal ended
            ended += 1
            self._settled(session.groups.pop(task, None))
            room.set()

        cap = inflight_cap(gen.cfg, session.engine, session.welcome.group_size)
        batch, first = first_wave(gen.cfg, cap)
        log.info("generator %s: up to %d groups in flight (%d until %d have ended)", gen.id, cap, first, batch)
        while not gen.stopping:
            limit = cap if ended >= batch else first
            if len(session.groups) >= limit:
                room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room.wait(), session.welcome.heartbeat_s)
                if gen.stopping:
                    break
            # as many as the engine has room for: the hub caps it by its generator.lease_size (a run-time knob).
            # With no room it still asks, for none, every heartbeat period: the answer says whether the run is over,
            # which it would otherwise hear only once a group finishes (minutes for long completions), while the
            # learner waits 15 s for its generators to leave
            asked = max(0, limit - len(session.groups))
            with gen.stages.span("lease", "leases", asked=asked) as span:
                reply = await session.ask(P.LeaseRequest(gen.id, asked))
                span["granted"] = len(getattr(reply, "groups", ()))
            if isinstance(reply, P.RunComplete):
                log.info("generator %s: the run is complete at version %d", gen.id, reply.version)
                gen.stopping = max(gen.stopping, 1)
                session.cancel_groups()  # nothing generated now can be trained
                await self._wait_version(reply.version, timeout=30.0)  # acknowledge the final weights
                break
            if isinstance(reply, P.Wait):  # asked again after retry_s, or as soon as the engine loads a new version:
                # the step that published it made room in the window (the hub opens it as it publishes). With its
                # engine full, a wider window would only queue more: that wait is the engine's (engine_full)
                stage = "engine_full" if session.engine.full() else "wait_room"
                with gen.stages.span(stage, "leases", why=reply.reason):
                    async with session.version_changed:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(session.version_changed.wait(), reply.retry_s)
                continue
            if isinstance(reply, P.Error):
                raise P.ProtocolError(f"lease refused: {reply.message}")
            if not isinstance(reply, P.Lease):
                raise P.ProtocolError(f"a lease request answered with {reply.tag}")
            session.held[reply.lease_id] = len(reply.groups)  # reported from now on, while it waits for weights too
            # k = 0: generate only on the newest weights; always on weights of this run. A lease that cannot start
            # (the hub took it back, or a drain began: a draining nccl/ipc generator receives no more versions) is
            # not started; a drain returns it with the Leave
            with gen.stages.span("wait_version", "leases", version=reply.min_version):
                started = await self._wait_version(reply.min_version, reply.lease_id)
            if not started or gen.draining.is_set():
                continue
            for item in reply.groups:
                task = asyncio.create_task(gen.group(session, reply, item))
                session.groups[task] = reply.lease_id
                task.add_done_callback(settled)
        while session.groups:  # draining: let the groups in flight finish
            await asyncio.sleep(0.05)

    def _settled(self, lease_id: int | None) -> None:
        """A group of `lease_id` is done (sent, failed or cancelled): the lease is off the books once all are."""
        held = self.session.held
        if lease_id in held:
            held[lease_id] -= 1
            if held[lease_id] <= 0:
                del held[lease_id]

    async def _wait_version(self, version: int, lease_id: int | None = None, timeout: float | None = None) -> bool:
        """Wait until the engine holds weights `version` of this run; returns whether it does. The wait ends without
        them when a drain begins (no wait outlives the groups in flight), when the hub takes `lease_id` back, or
        after `timeout` seconds."""
        session = self.session

        async def loaded() -> None:
            async with session.version_changed:
                await session.version_changed.wait_for(
                    lambda: session.holds(version) or lease_id is not None and lease_id not in session.held)

        waits = [asyncio.create_task(loaded()), asyncio.create_task(self.owner.draining.wait())]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
        if not done:
            log.warning("generator %s: weights v%d did not arrive within %s s", self.owner.id, version, timeout)
        return session.holds(version)
