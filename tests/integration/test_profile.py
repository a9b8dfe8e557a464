"""One `pipeline run` of the tiny model, read by two tests:
- `--profile`: RUN_DIR/trace.json, a Chrome/Perfetto trace of every process, whose spans account for each learner
  step's wall time, and metrics.jsonl's per-step sums that agree with it (pipeline/trace.py);
- a generator on GPUs of its own starts beside the learner: the hub's port is chosen first, and the generator builds
  its engine from the run's config while the learner starts (generator/spec.py), then registers.
Neither setting changes what the other test reads, and one run's start (about 25 s on 2 cores) serves both.
"""

from __future__ import annotations

import json
import re

import pytest

from pipeline import netutil, trace
from pipeline.metrics import read_jsonl

pytestmark = pytest.mark.integration

STEPS = 6


@pytest.fixture(scope="module")
def profiled(module_procs, tmp_path_factory, model_cache):
    """The finished run: (its process, its directory)."""
    tmp = tmp_path_factory.mktemp("profiled")
    run_dir = tmp / "run"
    # heartbeats (which carry the generator's seconds) every 0.1 s: at the default 1 s, steps 1 to 5 may all be
    # trained from buffered rollouts within one second of step 0, before any heartbeat since generation began.
    # On this CPU machine the GPU sets only name CUDA_VISIBLE_DEVICES: what the launcher decides by is that they differ
    run = module_procs(["run", "--profile", "--run-dir", str(run_dir), "--set", f"trainer.total_steps={STEPS}",
                        "--set", "hub.heartbeat_s=0.1", "--set", "run.learner_gpus='0'",
                        "--set", "run.generator_gpus=['1']"], tmp / "run.log")
    assert run.wait(600) == 0, run.tail()
    return run, run_dir


def test_a_profiled_run_accounts_for_every_second_of_each_step(profiled):
    run, run_dir = profiled
    steps = STEPS
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
        phases: dict[str, float] = {}
        for e in learner:
            if e is not span and span["ts"] <= e["ts"] < end:
                phases[e["name"]] = phases.get(e["name"], 0.0) + e["dur"]
        early = phases.pop("early", 0.0)  # inside `wait` (learner/early.py's looks, any number of them a step)
        assert early <= phases["wait"], (span, phases, early)
        # the phases add up to the step's wall time (within 5 %), and the next step starts where this one ends
        assert abs(sum(phases.values()) - span["dur"]) <= 0.05 * span["dur"], (span, phases)
        if next_span is not None:
            assert abs(next_span["ts"] - end) < 2000, (span, next_span)  # microseconds
        # metrics.jsonl's sums are the trace's phases: the wait without what the learner computed in it
        for key, phase in (("time/wait_s", phases["wait"] - early), ("time/early_s", early),
                           ("time/step_s", phases["train"]), ("time/publish_s", phases["publish"])):
            assert abs(record.get(key, 0.0) * 1e6 - phase) < 1000, (key, record.get(key), phases, early)
    # the hub's and the generator's seconds reach the records too
    assert sum(r.get("time/hub/rollout_s", 0) for r in records) > 0
    assert sum(r.get("gen/generating_s", 0) for r in records) > 0 and sum(r.get("gen/score_s", 0) for r in records) > 0
    assert "timeline:" in run.tail()


def test_a_generator_on_gpus_of_its_own_starts_beside_the_learner(profiled):
    run, run_dir = profiled
    started = re.search(r"generator-0 pid (\d+) on GPUs 1, beside the learner", run.tail(200))
    assert started, run.tail(200)
    learner = (run_dir / "logs" / "learner.log").read_text()
    listening = re.search(r"hub listening on tcp://127\.0\.0\.1:(\d+)", learner)
    assert listening and (run_dir / "launch.yaml").read_text().count(f"port: {listening.group(1)}") == 1
    low, high = netutil._ephemeral()  # chosen where no other process's socket draws a port meanwhile
    assert not low <= int(listening.group(1)) <= high
    assert [r["version"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    (registered,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register"]
    assert f"-{started.group(1)}-" in registered["generator"]  # that process served the run
