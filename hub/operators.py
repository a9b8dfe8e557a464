"""What operators may ask of a running learner (`pipeline status`, `pipeline set`; with `auth.keys`, operator keys
only): the hub's status, and run-time changes of the knobs marked `runtime` in pipeline/config.py. A change is
range-checked, applied from the next batch the learner takes (every rank gets it with that batch; the reply names
its step), and appended to RUN_DIR/changes.jsonl, which `--resume` applies again."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from hub.journal import Journal
from hub.ledger import PromptLedger
from hub.registry import Registry
from pipeline import protocol as P
from pipeline.config import Config, ConfigError
from pipeline.runtime_knobs import apply_runtime_change

log = logging.getLogger(__name__)


class Operators:
    """Built by the hub over its parts, called under its lock; the hub's version and failure come with each call."""

    def __init__(self, cfg: Config, ledger: PromptLedger, registry: Registry, journal: Journal, counters: dict,
                 run_dir: Path, run_id: str, secured: bool):
        self.cfg, self.ledger, self.registry, self.journal, self.counters = cfg, ledger, registry, journal, counters
        self.run_dir, self.run_id, self.secured = run_dir, run_id, secured

    def status(self, version: int, failure: str, verdict: str = "") -> P.StatusReply:
        ledger = self.ledger
        leases: dict[str, int] = {}
        for lease in ledger.leases.values():
            leases[lease.generator_id] = leases.get(lease.generator_id, 0) + 1
        return P.StatusReply(
            self.run_id, version, self.cfg.trainer.max_staleness, self.cfg.trainer.batch_size, len(ledger.buffer),
            ledger.in_flight(), len(ledger.pending), ledger.trained, dict(self.counters), failure, self.secured,
            self.registry.status(version, leases), verdict)

    def set_knob(self, msg: P.SetRequest, version: int, step: int) -> P.Message:
        """`step`: the first step whose batch is not taken yet (a batch already taken keeps the knobs it was built
        under)."""
        try:
            value = apply_runtime_change(self.cfg, msg.key, msg.value)
        except ConfigError as e:
            return P.Error(str(e))
        self.journal.event("set", key=msg.key, value=value, version=version, from_step=step)
        with (self.run_dir / "changes.jsonl").open("a") as f:
            f.write(json.dumps({"time": time.time(), "version": version, "from_step": step, "key": msg.key,
                                "value": value}) + "\n")
        log.info("run-time change: %s = %r (from step %d)", msg.key, value, step)
        return P.SetReply(msg.key, value, step)
