from __future__ import annotations

import asyncio
import contextlib
import logging

from pipeline import protocol as P

log = logging.getLogger(__name__)


FIRST_WAVE_QUARTERS = 5  # the first wave, in quarters of a batch (`Generator.first_wave`)


class LeaseLoop:
    async def _leases(self) -> None:
        room = asyncio.Event()
        ended = 0  # groups sent, failed or cancelled

        def settled(task: asyncio.Task) -> None:  # a group ended: its lease may be done, and there is room
            nonlocal ended
            ended += 1
            self._settled(self.groups.pop(task, None))
            room.set()

        cap = self.inflight_cap()
        batch, first = self.first_wave(cap)
        log.info("generator %s: up to %d groups in flight (%d until %d have ended)", self.id, cap, first, batch)
        while not self.stopping:
            limit = cap if ended >= batch else first
            if len(self.groups) >= limit:
                room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room.wait(), self.welcome.heartbeat_s)
                if self.stopping:
                    break
            # as many as the engine has room for: the hub caps it by its generator.lease_size (a run-time knob).
            # With no room it still asks, for none, every heartbeat period: the answer says whether the run is over,
            # which it would otherwise hear only once a group finishes (minutes for long completions), while the
            # learner waits 15 s for its generators to leave
            asked = max(0, limit - len(self.groups))
            with self.stages.span("lease", "leases", asked=asked) as span:
                reply = await self._ask(P.LeaseRequest(self.id, asked))
                span["granted"] = len(getattr(reply, "groups", ()))
            if isinstance(reply, P.RunComplete):
                log.info("generator %s: the run is complete at version %d", self.id, reply.version)
                self.stopping = max(self.stopping, 1)
                for t in list(self.groups):  # nothing generated now can be trained
                    t.cancel()
                await self._wait_version(reply.version, timeout=30.0)  # acknowledge the final weights
                break
            if isinstance(reply, P.Wait):  # asked again after retry_s, or as soon as the engine loads a new version:
                # the step that published it made room in the window (the hub opens it as it publishes). With its
                # engine full, a wider window would only queue more: that wait is the engine's (engine_full)
                stage = "engine_full" if self.engine.full() else "wait_room"
                with self.stages.span(stage, "leases", why=reply.reason):
                    async with self.version_changed:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.version_changed.wait(), reply.retry_s)
                continue
            if isinstance(reply, P.Error):
                raise P.ProtocolError(f"lease refused: {reply.message}")
            if not isinstance(reply, P.Lease):
                raise P.ProtocolError(f"a lease request answered with {reply.tag}")
            self.held[reply.lease_id] = len(reply.groups)  # reported from now on, while it waits for weights too
            # k = 0: generate only on the newest weights; always on weights of this run. A lease that cannot start
            # (the hub took it back, or a drain began: a draining nccl/ipc generator receives no more versions) is
            # not started; a drain returns it with the Leave
            with self.stages.span("wait_version", "leases", version=reply.min_version):
                started = await self._wait_version(reply.min_version, reply.lease_id)
            if not started or self.draining.is_set():
                continue
            for item in reply.groups:
                task = asyncio.create_task(self._group(reply, item))
                self.groups[task] = reply.lease_id
                task.add_done_callback(settled)
        while self.groups:  # draining: let the groups in flight finish
            await asyncio.sleep(0.05)

    def inflight_cap(self) -> int:
        """generator.max_inflight_groups, or (0) what the engine runs at once in groups, plus one lease waiting."""
        if self.cfg.generator.max_inflight_groups:
            return self.cfg.generator.max_inflight_groups
        seqs = self.engine.concurrent_sequences()
        return -(-seqs // max(1, self.welcome.group_size)) + self.cfg.generator.lease_size

    def first_wave(self, cap: int) -> tuple[int, int]:
        """(a batch in groups, the first wave): until a batch's worth of its groups have ended, a generator keeps no
        more than 5/4 of a batch in flight (FIRST_WAVE_QUARTERS). The learner's first step waits for one batch, and an
        engine finishes a batch sooner among fewer sequences: on one H200 with configs/gpu-smollm2-math.yaml the first
        batch came 1.8 s after registration with 40 groups in flight against 3.7-6.1 s with 132 (docs/figures.md,
        "The first wave"). Once they have ended it fills its engine, long before the first step is trained."""
        batch = max(1, self.cfg.trainer.batch_size)
        return batch, min(cap, -(-batch * FIRST_WAVE_QUARTERS // 4))

    def _settled(self, lease_id: int | None) -> None:
        """A group of `lease_id` is done (sent, failed or cancelled): the lease is off the books once all are."""
        if lease_id in self.held:
            self.held[lease_id] -= 1
            if self.held[lease_id] <= 0:
                del self.held[lease_id]

    async def _wait_version(self, version: int, lease_id: int | None = None, timeout: float | None = None) -> bool:
        """Wait until the engine holds weights `version` of this run; returns whether it does. The wait ends without
        them when a drain begins (no wait outlives the groups in flight), when the hub takes `lease_id` back, or
        after `timeout` seconds."""
        async def loaded() -> None:
            async with self.version_changed:
                await self.version_changed.wait_for(
                    lambda: self._holds(version) or lease_id is not None and lease_id not in self.held)

        waits = [asyncio.create_task(loaded()), asyncio.create_task(self.draining.wait())]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
        if not done:
            log.warning("generator %s: weights v%d did not arrive within %s s", self.id, version, timeout)
        return self._holds(version)
