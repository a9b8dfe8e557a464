from __future__ import annotations

import asyncio
import logging
import time

from generator.session import LoadFailed
from pipeline import protocol as P
from weights import VersionGone

log = logging.getLogger(__name__)


class WeightsLoop:
    async def _pushed(self) -> None:
        """Weight announcements: the hub pushes them on the control channel, in order with its replies."""
        while True:
            msg = await self.client.pushed.get()
            if isinstance(msg, P.WeightsReady):
                self.announced.put_nowait(msg)

    async def _weights(self) -> None:
        while True:
            ready = await self.announced.get()
            if not self.receiver.accepts(ready):
                continue  # announcements of another kind of transport
            if self.receiver.in_order:  # broadcasts: each must be received, in order (the learner is sending it)
                if not self.draining.is_set():  # the hub closes a draining generator's group: no more broadcasts
                    await self._apply(ready)
                continue
            while not self.announced.empty():  # files: skip to the newest announced version
                newer = self.announced.get_nowait()
                if self.receiver.accepts(newer) and newer.version > ready.version:
                    ready = newer
            if not self._holds(ready.version):
                await self._apply(ready)

    async def _apply(self, ready: P.WeightsReady) -> None:
        with self.stages.span("weights", "weights", version=ready.version) as span:
            await self._load(ready, span)

    async def _load(self, ready: P.WeightsReady, span: dict) -> None:
        start = time.perf_counter()
        try:
            stopped_ms = await self.receiver.apply(ready, self.engine)  # a file is verified before the engine stops
        except VersionGone as e:  # a newer version replaced it before it was read: take that one, same session
            log.warning("generator %s: weights v%d skipped: %s", self.id, ready.version, e)
            return
        except (P.ProtocolError, asyncio.CancelledError):
            raise
        except Exception as e:  # e.g. a broadcast that timed out: a new registration builds a new group
            self._raise_if_dead(e)  # not a failed transfer: nothing to register again for
            if self.receiver.in_order and self.draining.is_set():  # the hub aborted a draining generator's group
                log.info("generator %s: weights v%d not received while draining (%s)", self.id, ready.version, e)
                return
            self.load_failures += 1
            raise LoadFailed(f"weights v{ready.version} could not be loaded: {e}") from e
        self.engine.run_id = self.welcome.run_id
        self.load_failures = 0
        total_ms = (time.perf_counter() - start) * 1000
        swap = self.engine.last_swap_ms
        span.update(stopped_ms=stopped_ms, **swap)
        log.info("weights v%d applied: %.0f ms (%.0f ms stopped), %.0f ms after the optimizer step; %spausing took "
                 "%.0f ms, the load call %.0f ms, of which %.0f ms in the workers", ready.version, total_ms, stopped_ms,
                 (time.time() - ready.published_at) * 1000 if ready.published_at else 0,
                 f"received in {swap['receive']:.0f} ms while generating; " if "receive" in swap else "",
                 swap.get("pause", 0), swap.get("load", 0), swap.get("worker", 0))
        async with self.version_changed:
            self.version_changed.notify_all()
        await self._ask(P.WeightsApplied(self.id, ready.version, total_ms, self.receiver.via))
