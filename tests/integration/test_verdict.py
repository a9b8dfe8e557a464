"""What holds a run back (pipeline/verdict.py), on CPU runs whose bound is known: a reward function that sleeps binds
the rewards, k = 0 with the tiny model's fast learner binds the window, and a learner slowed by the test hook
(PIPELINE_TEST_SLOW_STEP_S, pipeline/environment.py) binds the learner's compute. Each run says so at step 9 (its record
and the learner's log) and at its end (`pipeline run`'s last lines).

Ten steps each: the first verdict comes at step 9, over steps 2-9. Heartbeats every 0.2 s, so that the generators'
seconds reach the records of those eight steps (at the default 1 s, eight fast steps may see none).
"""

from __future__ import annotations

import pytest

from pipeline.metrics import read_jsonl

pytestmark = pytest.mark.integration

STEPS = 10


def _bound(procs, tmp_path, overrides: list[str], env: dict | None = None) -> tuple[dict, str]:
    """The step-9 record's verdict fields and `pipeline run`'s output of a run with `overrides`."""
    run_dir = tmp_path / "run"
    args = ["run", "--run-dir", str(run_dir), "--set", f"trainer.total_steps={STEPS}", "--set", "hub.heartbeat_s=0.2"]
    for o in overrides:
        args += ["--set", o]
    run = procs(args, tmp_path / "run.log", env)
    assert run.wait(600) == 0, run.tail()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["step"] for r in records if "verdict/stage" in r] == [9]
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "what holds the run back, steps 2-9" in learner_log and "what held the run back, steps 2-9" in learner_log
    said = next(line for line in run.tail().splitlines() if line.startswith("bound: "))
    print(said)
    return {k: v for k, v in records[-1].items() if k.startswith("verdict/")}, said


def test_a_reward_function_that_sleeps_binds_the_rewards(procs, tmp_path, model_cache):
    verdict, said = _bound(procs, tmp_path, ["rewards=[{fn: 'tests.integration.slow_rewards:slow_echo'}]"])
    assert verdict["verdict/stage"] == "rewards", verdict
    assert said.startswith("bound: steps 2-9") and "the reward functions took" in said


def test_k0_with_a_fast_learner_binds_the_window(procs, tmp_path, model_cache):
    """A reward of 0 for every sample, too: nothing to train (faster still), and the learner says that nothing is
    learned (learner/signal.py)."""
    verdict, said = _bound(procs, tmp_path, ["trainer.max_staleness=0",
                                             "rewards=[{fn: 'tests.integration.slow_rewards:nothing'}]"])
    assert verdict["verdict/stage"] == "the window", verdict
    assert "`trainer.max_staleness=1` lets a batch generate while a step trains" in said
    learner_log = (tmp_path / "run" / "logs" / "learner.log").read_text()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    groups = sum(len(r["trained"]) for r in records)
    assert f"no learning signal in steps 0-9: {groups} of {groups} groups had one reward" in learner_log
    assert "(reward 0.000," in learner_log


def test_a_slow_learner_binds_the_learners_compute(procs, tmp_path, model_cache):
    # k = 2: two batches may generate ahead of the slow steps, and 2 s a step: a batch that a loaded machine takes
    # seconds to generate (3.7 s once, on 2 shared cores) is not waited for
    verdict, said = _bound(procs, tmp_path, ["trainer.max_staleness=2"], env={"PIPELINE_TEST_SLOW_STEP_S": "2.0"})
    assert verdict["verdict/stage"] == "learner compute", verdict
    assert verdict["verdict/train"] > 0.6, verdict
    assert "the learner sets the pace" in said
