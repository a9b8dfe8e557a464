"""A group that can no longer be trained stops where it runs (generator/session.py `stop_stale`), on a real run: the
tiny model's `pipeline run` on CPU at k = 1, whose generator holds its first group (tests/integration/slow_rollouts.py)
as a group of very long completions would be held. Once the generator loads a version more than k past that group's
start, it stops the group and the hub leases its prompt again: the prompt is trained later, under a version within k,
and the run ends with every step."""

from __future__ import annotations

import json

import pytest

from pipeline.metrics import read_jsonl

pytestmark = pytest.mark.integration

STEPS = 8


def test_a_group_that_can_no_longer_be_trained_is_stopped_and_its_prompt_trained_later(procs, tmp_path, model_cache):
    run_dir, held = tmp_path / "run", tmp_path / "held.json"
    rollout = "generator.rollout=tests.integration.slow_rollouts:first_group_held"
    run = procs(["run", "--run-dir", str(run_dir), "--set", f"trainer.total_steps={STEPS}", "--set",
                 "trainer.max_staleness=1", "--set", rollout, "--set", "hub.heartbeat_s=0.2"], tmp_path / "run.log",
                {"ROLLOUT_HELD": str(held)})
    assert run.wait(600) == 0, run.tail()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert sum(r.get("staleness/stopped", 0) for r in records) >= 1  # the held group, stopped at its generator
    assert records[-1]["hub/stale_stopped"] >= 1
    epoch, prompt = json.loads(held.read_text())
    trained = [(r["step"], t[2]) for r in records for t in r["trained"] if (t[0], t[1]) == (epoch, prompt)]
    assert trained, f"prompt {(epoch, prompt)} of the stopped group was never trained"
    assert all(0 <= step - behaviour <= 1 for step, behaviour in trained), trained  # leased again, within k
    generator_log = next((run_dir / "logs").glob("generator*.log")).read_text()
    assert "groups that can no longer be trained (trainer.max_staleness=1)" in generator_log
