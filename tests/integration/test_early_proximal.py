"""trainer.early_proximal on a real run (`pipeline run`, the embedded demo with m2po): while the learner waits for its
batch it computes the proximal log-probs of the groups buffered first (learner/early.py), and the steps take them.

k = 0, so that every step waits for its whole batch, whose groups arrive a few at a time (a reward function that takes
0.2 s a group, tests/integration/slow_rewards.py), and micro-batches of 128 tokens, so that a few groups fill one. The
exactness of what the step trains with them: tests/integration/test_learner_step.py's
`test_proximal_log_probs_computed_while_waiting_train_the_step_as_computed_in_it`.
"""

from __future__ import annotations

import pytest

from pipeline.metrics import read_jsonl

pytestmark = pytest.mark.integration

STEPS = 8


def test_a_waiting_learner_computes_the_proximal_log_probs_of_its_first_groups(procs, tmp_path, model_cache):
    run_dir = tmp_path / "run"
    args = ["run", "--run-dir", str(run_dir)]
    for o in (f"trainer.total_steps={STEPS}", "trainer.max_staleness=0", "trainer.loss=m2po",
              "trainer.micro_batch_tokens=128", "trainer.checkpoint_every=0",
              "rewards=[{fn: 'tests.integration.slow_rewards:slow_echo'}]"):
        args += ["--set", o]
    run = procs(args, tmp_path / "run.log")
    assert run.wait(600) == 0, run.tail()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["staleness/max_lag"] == 0 for r in records)  # k = 0: every group of version v trained at step v
    early = [r["learner/early_rows"] for r in records]
    rows = [8 * len(r["trained"]) for r in records]  # the demo's group_size: rows of its groups with a signal or not
    print("rows computed while waiting", early, "of", rows)
    assert sum(early) > 0 and all(0 <= e <= n for e, n in zip(early, rows, strict=True))
    # the time they took is the learner's compute, not its wait
    assert all(r.get("time/early_s", 0.0) > 0 for r, e in zip(records, early, strict=True) if e)
