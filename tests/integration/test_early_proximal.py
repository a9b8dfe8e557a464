"""trainer.early_proximal on a real run (`pipeline run`, the embedded demo with m2po): while the learner waits for its
batch it computes the proximal log-probs of the groups buffered first (learner/early.py), and the steps take them.

k = 0, so that every step waits for its whole batch, whose groups arrive a few at a time (a reward function that takes
0.2 s a group, tests/integration/slow_rewards.py), and micro-batches of 128 tokens, so that a few groups fill one. The
exactness of what the step trains with them: tests/integration/test_learner_step.py's
`test_proximal_log_probs_computed_while_waiting_train_the_step_as_computed_in_it`.
"""

from __future__ import annotations

import json
import sys

import pytest

from pipeline.metrics import read_jsonl
from pipeline.netutil import reserved_port
from tests.conftest import Proc, wait_for
from tests.integration.helpers import start_generator

pytestmark = pytest.mark.integration

STEPS = 8
SLOW = "rewards=[{fn: 'tests.integration.slow_rewards:slow_echo'}]"
LEARNER = (f"trainer.total_steps={STEPS}", "trainer.max_staleness=0", "trainer.loss=m2po",
           "trainer.micro_batch_tokens=128", "trainer.checkpoint_every=0")


def test_a_waiting_learner_computes_the_proximal_log_probs_of_its_first_groups(procs, tmp_path, model_cache):
    run_dir = tmp_path / "run"
    args = ["run", "--run-dir", str(run_dir)]
    for o in (*LEARNER, SLOW):
        args += ["--set", o]
    run = procs(args, tmp_path / "run.log")
    assert run.wait(600) == 0, run.tail()
    computed_ahead(run_dir)


def test_two_learner_ranks_compute_them_ahead_together(procs, tmp_path, model_cache):
    """Two gloo ranks under torchrun: rank 0 hears the hub and sends the other its news at each look
    (learner/service.py `share_news`); both take the same rows and share each micro-batch's forward, as the step does.
    A rank that chose another micro-batch would wait in a collective the other never joins: the run would not end."""
    run_dir, hub_port = tmp_path / "run", reserved_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(reserved_port()), "-m", "pipeline", "learner", "-c", "configs/demo.yaml", "--run-dir", str(run_dir),
            "--set", f"hub.port={hub_port}", "--set", SLOW]
    for o in LEARNER:
        argv += ["--set", o]
    learner = Proc(argv, tmp_path / "learner.log")
    try:
        wait_for(lambda: (run_dir / "hub.json").exists() and json.loads((run_dir / "hub.json").read_text()), 600,
                 "rank 0's hub.json", [learner])
        gen = start_generator(procs, run_dir, hub_port, [SLOW])
        assert learner.wait(600) == 0, learner.tail()
        assert gen.wait(120) == 0, gen.tail()
    finally:
        learner.stop()
    assert "learner rank 1 of 2" in (tmp_path / "learner.log").read_text()
    computed_ahead(run_dir)


def computed_ahead(run_dir) -> None:
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["staleness/max_lag"] == 0 for r in records)  # k = 0: every group of version v trained at step v
    early = [r["learner/early_rows"] for r in records]
    rows = [8 * len(r["trained"]) for r in records]  # the demo's group_size: rows of its groups with a signal or not
    print("rows computed while waiting", early, "of", rows)
    assert sum(early) > 0 and all(0 <= e <= n for e, n in zip(early, rows, strict=True))
    # the time they took is the learner's compute, not its wait
    assert all(r.get("time/early_s", 0.0) > 0 for r, e in zip(records, early, strict=True) if e)
