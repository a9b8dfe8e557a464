"""`pipeline run --profile`: RUN_DIR/trace.json, a Chrome/Perfetto trace of every process, whose spans account for
each learner step's wall time, and metrics.jsonl's per-step sums that agree with it (pipeline/trace.py)."""

from __future__ import annotations

import json

import pytest

from pipeline import trace
from pipeline.metrics import read_jsonl

pytestmark = pytest.mark.integration


def test_a_profiled_run_accounts_for_every_second_of_each_step(procs, tmp_path, model_cache):
    run_dir = tmp_path / "run"
    steps = 6
    # heartbeats (which carry the generator's seconds) every 0.1 s: at the default 1 s, steps 1 to 5 may all be
    # trained from buffered rollouts within one second of step 0, before any heartbeat since generation began
    run = procs(["run", "--profile", "--run-dir", str(run_dir), "--set", f"trainer.total_steps={steps}",
                 "--set", "hub.heartbeat_s=0.1"], tmp_path / "run.log")
    assert run.wait(600) == 0, run.tail()
    events = trace.read(run_dir / "trace.json")
    json.dumps(events)  # plain JSON: what ui.perfetto.dev and chrome://tracing read
    spans = trace.spans(events)
    on = {(e["track"], e["name"]) for e in spans}
    assert {("learner", n) for n in ("wait", "train", "publish", "record", "step")} <= on
    assert {("hub", "decode"), ("hub", "rollout"), ("hub", "lease_request"), ("leases", "lease"),
            ("weights", "weights"), ("group 0", "generate"), ("group 0", "score"), ("group 0", "send")} <= on
    assert any(e["ph"] == "C" and e["name"] == "groups generating" for e in events)
    assert sum(1 for e in spans if e["name"] == "send") >= steps * 16  # every trained group was sent, and traced

    learner = [e for e in spans if e["track"] == "learner"]
    step_spans = [e for e in learner if e["name"] == "step"]
    assert [e["args"]["step"] for e in step_spans] == list(range(steps))
    records = read_jsonl(run_dir / "metrics.jsonl")
    for span, next_span, record in zip(step_spans, step_spans[1:] + [None], records, strict=True):
        end = span["ts"] + span["dur"]
        phases = {e["name"]: e["dur"] for e in learner if e is not span and span["ts"] <= e["ts"] < end}
        # the phases add up to the step's wall time (within 5 %), and the next step starts where this one ends
        assert abs(sum(phases.values()) - span["dur"]) <= 0.05 * span["dur"], (span, phases)
        if next_span is not None:
            assert abs(next_span["ts"] - end) < 2000, (span, next_span)  # microseconds
        # metrics.jsonl's sums are the trace's phases
        for key, phase in (("time/wait_s", "wait"), ("time/step_s", "train"), ("time/publish_s", "publish")):
            assert abs(record[key] * 1e6 - phases[phase]) < 1000, (key, record[key], phases)
    # the hub's and the generator's seconds reach the records too
    assert sum(r.get("time/hub/rollout_s", 0) for r in records) > 0
    assert sum(r.get("gen/generating_s", 0) for r in records) > 0 and sum(r.get("gen/score_s", 0) for r in records) > 0
    assert "timeline:" in run.tail()
