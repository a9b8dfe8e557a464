"""`pipeline run` starts a generator on GPUs of its own beside the learner: the hub's port is chosen first, and the
generator builds its engine from the run's config while the learner starts (generator/spec.py), then registers."""

from __future__ import annotations

import re

import pytest

from pipeline.metrics import read_jsonl

pytestmark = pytest.mark.integration


def test_a_generator_on_gpus_of_its_own_starts_beside_the_learner(procs, tmp_path, model_cache):
    run_dir = tmp_path / "run"
    # on this CPU machine the GPU sets only name CUDA_VISIBLE_DEVICES: what the launcher decides by is that they differ
    run = procs(["run", "--run-dir", str(run_dir), "--set", "trainer.total_steps=4", "--set", "run.learner_gpus='0'",
                 "--set", "run.generator_gpus=['1']"], tmp_path / "run.log")
    assert run.wait(600) == 0, run.tail()
    started = re.search(r"generator-0 pid (\d+) on GPUs 1, beside the learner", run.tail(200))
    assert started, run.tail(200)
    learner = (run_dir / "logs" / "learner.log").read_text()
    listening = re.search(r"hub listening on tcp://127\.0\.0\.1:(\d+)", learner)
    assert listening and (run_dir / "launch.yaml").read_text().count(f"port: {listening.group(1)}") == 1
    assert [r["version"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    (registered,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register"]
    assert f"-{started.group(1)}-" in registered["generator"]  # that process served the run
