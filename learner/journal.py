"""What the hub records: events in RUN_DIR/events.jsonl (one JSON object a line), and warnings rate-limited by kind
so that a hostile peer cannot flood the log (what is not logged is still counted by the hub)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("learner.hub")


class Journal:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "events.jsonl"
        self._logged: dict[str, list[float]] = {}  # kind -> times of the warnings logged in the last minute

    def event(self, name: str, **fields) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"time": time.time(), "event": name, **fields}) + "\n")

    def warn(self, kind: str, fmt: str, *args, per_minute: int = 10) -> None:
        """A warning, at most `per_minute` of one kind a minute."""
        now = time.monotonic()
        times = self._logged.setdefault(kind, [])
        times[:] = [t for t in times if now - t < 60]
        if len(times) < per_minute:
            times.append(now)
            log.warning(fmt + ("" if len(times) < per_minute else " (more of these are counted, not logged, for "
                                                                   "a minute)"), *args)
