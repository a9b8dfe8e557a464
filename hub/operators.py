"""What operators may ask of a running learner (`pipeline status`, `pipeline set`; with `auth.keys`, operator keys
only): the hub's status, and run-time changes of the knobs marked `runtime` in pipeline/config.py. A change is
range-checked, applied from the next batch the learner takes (every rank gets it with that batch; the reply names
its step), and appended to RUN_DIR/changes.jsonl, which `--resume` applies again."""

from __future__ import annotations

import json
import logging
import time

from pipeline import protocol as P
from pipeline.config import ConfigError, apply_runtime_change

log = logging.getLogger("hub.hub")


def status(hub) -> P.StatusReply:
    ledger = hub.ledger
    leases: dict[str, int] = {}
    for lease in ledger.leases.values():
        leases[lease.generator_id] = leases.get(lease.generator_id, 0) + 1
    return P.StatusReply(
        hub.run_id, hub.version, hub.cfg.trainer.max_staleness, hub.cfg.trainer.batch_size, len(ledger.buffer),
        ledger.in_flight(), len(ledger.pending), ledger.trained, dict(hub.counters), hub.failure,
        hub.auth is not None, hub.registry.status(hub.version, leases))


def set_knob(hub, msg: P.SetRequest) -> P.Message:
    try:
        value = apply_runtime_change(hub.cfg, msg.key, msg.value)
    except ConfigError as e:
        return P.Error(str(e))
    step = hub.next_step()  # a batch already taken keeps the knobs it was built under
    hub.journal.event("set", key=msg.key, value=value, version=hub.version, from_step=step)
    with (hub.run_dir / "changes.jsonl").open("a") as f:
        f.write(json.dumps({"time": time.time(), "version": hub.version, "from_step": step, "key": msg.key,
                            "value": value}) + "\n")
    log.info("run-time change: %s = %r (from step %d)", msg.key, value, step)
    return P.SetReply(msg.key, value, step)
