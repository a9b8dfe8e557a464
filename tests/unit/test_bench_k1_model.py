"""bench/k1_model.py, the model of k = 1's wait that weighed holding a newer batch back on an engine: the learner
never waits when the engines outrun it, waits when they do not, and the two policies differ only in the engines."""

from __future__ import annotations

import pytest

from bench.k1_model import run

STEPS = 40


@pytest.mark.parametrize("policy", ["now", "hold"])
def test_engines_far_faster_than_training_leave_the_learner_no_wait(policy):
    rate, wait = run(policy, steps=STEPS, T=0.45, pub=0.05, a=1e-5, c=1e-7, f=1.0)
    assert wait == 0.0
    assert rate == pytest.approx(60 / 0.5)  # a step every T + pub


@pytest.mark.parametrize("policy", ["now", "hold"])
def test_engines_slower_than_training_make_the_learner_wait_and_the_rate_fall(policy):
    fast, _ = run(policy, steps=STEPS, a=1e-5, c=1e-7)
    rate, wait = run(policy, steps=STEPS, a=8e-3, c=0.05e-3, f=2.0, mean=40)
    assert wait > 0.1 and rate < fast


def test_the_policies_differ_where_a_straggler_shares_its_engine_and_the_model_is_seeded():
    now = run("now", steps=STEPS, f=1.5, mean=36, seed=1)
    assert now == run("now", steps=STEPS, f=1.5, mean=36, seed=1)
    assert now != run("hold", steps=STEPS, f=1.5, mean=36, seed=1)
