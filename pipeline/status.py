"""Text rendering of the hub's status (pipeline.protocol.StatusReply) for `pipeline status`."""

from __future__ import annotations


def render(s) -> str:
    c = s.counters
    shown = [("rollouts", "rollouts"), ("tokens", "tokens"), ("requeued", "re-queued"),
             ("stale_dropped", "stale dropped"), ("stale_stopped", "stale stopped"),
             ("duplicates", "duplicates"), ("unknown_lease", "unknown lease"), ("lost_leases", "lost leases"),
             ("bad_messages", "bad messages"), ("refused", "refused"), ("unlisted_keys", "unlisted keys"),
             ("muted", "muted"),
             ("quarantined", "quarantined"), ("rejected_prompts", "rejected prompts"),
             ("reward_errors", "reward errors"), ("skipped_steps", "skipped steps"),
             ("journal_dropped", "journal dropped"), ("refused_spec", "refused (config)")]
    lines = [
        f"run {s.run_id}  version {s.version}  max_staleness {s.max_staleness}  batch {s.batch_size}",
        f"buffer {s.buffer}  in flight {s.in_flight}  pending {s.pending}  trained {s.trained}",
        "  ".join(f"{label} {c.get(key, 0)}" for key, label in shown),
        "rejected rollouts " + (", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in sorted(c.items())
                                          if k.startswith("rejected/")) or "0"),
        *([f"FAILED: {s.failure}"] if s.failure else []),
        *([f"bound: {s.verdict}"] if s.verdict else []),
        "",
        f"{'generator':<34} {'host':<16} {'gpus':<6} {'version':>7} {'lag':>4} {'tok/s':>8} {'leases':>6} "
        f"{'heartbeat':>9}",
    ]
    for g in s.generators:
        lag = "-" if g.lag < 0 else g.lag
        lines.append(f"{g.id:<34} {g.host[:16]:<16} {g.gpus or '-':<6} {g.version:>7} {lag:>4} "
                     f"{g.tokens_per_s:>8.0f} {g.leases:>6} {g.last_heartbeat_s:>8.1f}s"
                     + (f"  {g.adapter_slots} adapter slots" if g.adapter_slots else "")
                     + ("  draining" if g.draining else ""))
    if not s.generators:
        lines.append("(no generators)")
    return "\n".join(lines)
