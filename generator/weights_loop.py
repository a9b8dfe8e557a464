"""The weights loop of one session: load each version the hub announces, in the way its transport needs.

    WeightsReady    pushed by the hub on the control channel, in order with its replies (`announcements`: the
                    current version right after the Welcome) -> receiver.apply: fetched and loaded into the engine
                    -> WeightsApplied
A broadcast (nccl) must be received, each in order, except by a draining generator, which takes no more; a file-like
transport skips to the newest version announced. Once a version is loaded, the training groups whose samples can no
longer be trained at it stop (`Session.stop_stale`). A version that fails to load ends the session (LoadFailed: it
registers again); MAX_LOAD_FAILURES in a row end the generator. The generator (generator/service.py) builds one per
session (generator/session.py), and counts the failures in a row (`Owner`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from generator.session import LoadFailed, Session
from generator.stages import Stages
from pipeline import protocol as P
from pipeline.config import Config
from weights import VersionGone

log = logging.getLogger(__name__)


class Owner(Protocol):
    """What the weights loop uses of its generator (generator/service.py)."""

    id: str
    draining: asyncio.Event  # a signal began the drain: no more broadcasts
    stages: Stages
    load_failures: int  # versions that failed to load in a row, across sessions

    @property
    def cfg(self) -> Config: ...


class WeightsLoop:
    def __init__(self, owner: Owner, session: Session):
        self.owner, self.session = owner, session

    async def announcements(self) -> None:
        """Weight announcements: the hub pushes them on the control channel, in order with its replies."""
        while True:
            msg = await self.session.client.pushed.get()
            if isinstance(msg, P.WeightsReady):
                self.session.announced.put_nowait(msg)

    async def run(self) -> None:
        """Load the versions announced, as the session's receiver takes them."""
        gen, session = self.owner, self.session
        while True:
            ready = await session.announced.get()
            if not session.receiver.accepts(ready):
                continue  # announcements of another kind of transport
            if session.receiver.in_order:  # broadcasts: each must be received, in order (the learner is sending it)
                if not gen.draining.is_set():  # the hub closes a draining generator's group: no more broadcasts
                    await self._apply(ready)
                continue
            while not session.announced.empty():  # files: skip to the newest announced version
                newer = session.announced.get_nowait()
                if session.receiver.accepts(newer) and newer.version > ready.version:
                    ready = newer
            if not session.holds(ready.version):
                await self._apply(ready)

    async def _apply(self, ready: P.WeightsReady) -> None:
        with self.owner.stages.span("weights", "weights", version=ready.version) as span:
            await self._load(ready, span)

    async def _load(self, ready: P.WeightsReady, span: dict) -> None:
        gen, session = self.owner, self.session
        start = time.perf_counter()
        try:
            stopped_ms = await session.receiver.apply(ready, session.engine)  # a file is verified before the pause
        except VersionGone as e:  # a newer version replaced it before it was read: take that one, same session
            log.warning("generator %s: weights v%d skipped: %s", gen.id, ready.version, e)
            return
        except (P.ProtocolError, asyncio.CancelledError):
            raise
        except Exception as e:  # e.g. a broadcast that timed out: a new registration builds a new group
            session.raise_if_dead(e)  # not a failed transfer: nothing to register again for
            if session.receiver.in_order and gen.draining.is_set():  # the hub aborted a draining generator's group
                log.info("generator %s: weights v%d not received while draining (%s)", gen.id, ready.version, e)
                return
            gen.load_failures += 1
            raise LoadFailed(f"weights v{ready.version} could not be loaded: {e}") from e
        session.engine.run_id = session.welcome.run_id
        gen.load_failures = 0
        total_ms = (time.perf_counter() - start) * 1000
        swap = session.engine.last_swap_ms
        span.update(stopped_ms=stopped_ms, **swap)
        log.info("weights v%d applied: %.0f ms (%.0f ms stopped), %.0f ms after the optimizer step; %spausing took "
                 "%.0f ms, the load call %.0f ms, of which %.0f ms in the workers", ready.version, total_ms, stopped_ms,
                 (time.time() - ready.published_at) * 1000 if ready.published_at else 0,
                 f"received in {swap['receive']:.0f} ms while generating; " if "receive" in swap else "",
                 swap.get("pause", 0), swap.get("load", 0), swap.get("worker", 0))
        await session.version_changes()
        if stopped := session.stop_stale(ready.version, gen.cfg.trainer.max_staleness):
            log.info("generator %s: v%d stopped %d groups that can no longer be trained (trainer.max_staleness=%d); "
                     "their prompts are leased again", gen.id, ready.version, stopped, gen.cfg.trainer.max_staleness)
        await session.ask(P.WeightsApplied(gen.id, ready.version, total_ms, session.receiver.via))
