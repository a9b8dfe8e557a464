"""Where every second goes: a timeline of each process as Chrome trace events (`pipeline run --profile`).

A process that profiles (`start`) appends its events to DIR/<process>-<pid>.jsonl, one JSON object a line, written
at most a second after they happen and at exit; `merge` joins a run's RUN_DIR/trace/*.jsonl into RUN_DIR/trace.json,
which ui.perfetto.dev and chrome://tracing open. Times are the wall clock in microseconds (`time.time`), so the
processes of one host line up on one timeline. Each process has tracks (Chrome's threads), named as they are first
used:

    learner   step (one span per step: wait, train, publish, record, checkpoint inside it)
    hub       one span per message: decode, then what handling it took (rollout: validate and buffer; lease_request:
              admission; heartbeat, ...)
    generator leases (request round trips, waits for room), weights (waits for a version, loads), groups 0..N (one
              lane per group in flight: generate, score, encode, send), and counters: groups generating, event-loop lag

Off (the default), every call returns at once. The numbers that metrics.jsonl records per step are summed whether
or not a trace is written (`Sums`): tracing adds events, never a trained number.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from pathlib import Path

FLUSH_S = 1.0  # seconds an event may wait in memory before it is written


class Sums(dict):
    """Seconds per name, added up since the process started (one writer thread per instance)."""

    def add(self, name: str, seconds: float) -> None:
        self[name] = self.get(name, 0.0) + seconds


def gained(now: dict, before: dict) -> dict[str, float]:
    """What each name of a tally gained since `before` (an earlier copy of it)."""
    return {k: v - before.get(k, 0.0) for k, v in now.items()}


class Trace:
    def __init__(self):
        self.path: Path | None = None
        self._events: list[dict] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._flushed = 0.0

    @property
    def on(self) -> bool:
        return self.path is not None

    def start(self, directory: Path, process: str) -> None:
        """Trace this process into `directory` (made if missing), its events named `process` on the timeline."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{process}-{os.getpid()}.jsonl"
        self._meta("process_name", 0, name=process)
        atexit.register(self.flush)

    def span(self, name: str, track: str, sums: Sums | None = None, **args):
        """A context manager: the time inside it is an event `name` on `track`, and added to `sums[name]`."""
        if not self.on and sums is None:
            return contextlib.nullcontext({})  # the arguments a caller adds go nowhere
        return self._span(name, track, sums, args)

    @contextlib.contextmanager
    def _span(self, name: str, track: str, sums: Sums | None, args: dict):
        start = time.time()
        try:
            yield args  # the caller may add to the event's arguments
        finally:
            end = time.time()
            if sums is not None:
                sums.add(name, end - start)
            self.complete(name, track, start, end, **args)

    def complete(self, name: str, track: str, start: float, end: float, **args) -> None:
        """An event from `start` to `end` (seconds of `time.time`)."""
        if self.on:
            self._add({"name": name, "ph": "X", "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
                       "pid": os.getpid(), "tid": self._track(track), "args": args})

    def counter(self, name: str, **values: float) -> None:
        """A counter track `name` takes `values` from now on (drawn as a step chart)."""
        if self.on:
            self._add({"name": name, "ph": "C", "ts": time.time() * 1e6, "pid": os.getpid(), "args": values})

    def _track(self, track: str) -> int:
        tid = self._tracks.get(track)
        if tid is None:
            with self._lock:
                tid = self._tracks.setdefault(track, len(self._tracks) + 1)
            self._meta("thread_name", tid, name=track)
            self._meta("thread_sort_index", tid, sort_index=tid)
        return tid

    def _meta(self, kind: str, tid: int, **args) -> None:
        self._add({"name": kind, "ph": "M", "pid": os.getpid(), "tid": tid, "args": args})

    def _add(self, event: dict) -> None:
        self._events.append(event)
        if time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        with self._lock:
            events, self._events = self._events, []
            self._flushed = time.monotonic()
            if events:
                with self.path.open("a") as f:
                    f.writelines(json.dumps(e) + "\n" for e in events)


TRACE = Trace()  # this process's: off until `start`

span, complete, counter = TRACE.span, TRACE.complete, TRACE.counter


def start(directory: Path, process: str) -> None:
    TRACE.start(directory, process)


def on() -> bool:
    return TRACE.on


def trace_dir(run_dir: Path) -> Path:
    """Where a run's processes write their events."""
    return Path(run_dir) / "trace"


def merge(run_dir: Path) -> Path | None:
    """RUN_DIR/trace.json from every process's events in RUN_DIR/trace/ (a line cut short by a crash is left out);
    None when there are none."""
    events = []
    for part in sorted(trace_dir(run_dir).glob("*.jsonl")):
        for line in part.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    if not events:
        return None
    out = Path(run_dir) / "trace.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    os.replace(tmp, out)
    return out


def read(path: Path) -> list[dict]:
    """The events of a trace.json."""
    return json.loads(Path(path).read_text())["traceEvents"]


def spans(events: list[dict]) -> list[dict]:
    """The spans among `events`, each with the name of its track ("track"; "" where none was named)."""
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return [dict(e, track=tracks.get((e["pid"], e["tid"]), "")) for e in events if e["ph"] == "X"]
