"""What the hub records: events in RUN_DIR/events.jsonl (one JSON object a line), and warnings rate-limited by kind
so that a hostile peer cannot flood the log (what is not logged is still counted by the hub).

An event a peer causes (its registration, drain, leave, weights load, an expired lease, a prompt it rejected, ...)
is charged to that peer's principal (its key, or its id without keys): each principal may have at most
hub.journal_kib_per_minute KiB written a minute; the rest of that minute its events are counted
(`journal_dropped`), not written. So no key can fill the disk, while every other principal's events are kept.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Journal:
    def __init__(self, run_dir: Path, kib_per_minute: int = 0, counters: dict[str, int] | None = None):
        """`kib_per_minute`: per principal (0: unbounded); `counters`: the hub's (`journal_dropped`)."""
        self.path = run_dir / "events.jsonl"
        self.budget = kib_per_minute * 1024
        self.counters = counters if counters is not None else {}
        self._logged: dict[str, list[float]] = {}  # kind -> times of the warnings logged in the last minute
        self._written: dict[str, list] = {}  # principal -> [start of its minute, bytes written in it]

    def event(self, name: str, by: str = "", **fields: Any) -> None:
        """Append one event; `by`: the principal it is charged to ("": the hub's own, not bounded)."""
        line = json.dumps({"time": time.time(), "event": name, **fields}) + "\n"
        if by and not self._charge(by, len(line)):
            self.counters["journal_dropped"] = self.counters.get("journal_dropped", 0) + 1
            self.warn("journal", "hub: %s's events past hub.journal_kib_per_minute are counted, not written "
                      "(journal_dropped)", by.split(":", 1)[-1][:64])
            return
        with self.path.open("a") as f:
            f.write(line)

    def _charge(self, principal: str, size: int) -> bool:
        if not self.budget:
            return True
        now = time.monotonic()
        written = self._written.get(principal)
        if written is None or now - written[0] >= 60:
            if len(self._written) > 4096:  # principals gone quiet
                self._written = {p: w for p, w in self._written.items() if now - w[0] < 60}
            written = self._written[principal] = [now, 0]
        if written[1] + size > self.budget:
            return False
        written[1] += size
        return True

    def warn(self, kind: str, fmt: str, *args: object, per_minute: int = 10) -> None:
        """A warning, at most `per_minute` of one kind a minute."""
        now = time.monotonic()
        times = self._logged.setdefault(kind, [])
        times[:] = [t for t in times if now - t < 60]
        if len(times) < per_minute:
            times.append(now)
            log.warning(fmt + ("" if len(times) < per_minute else " (more of these are counted, not logged, for "
                                                                   "a minute)"), *args)
