"""Whether the steps still teach anything (learner/signal.py): a warning every ten steps while at least 90 % of the
groups had one reward for all their samples, none otherwise; the records as a collapsed run wrote them."""

from __future__ import annotations

from learner.signal import Signal


def _record(step: int, equal: int, groups: int = 32, reward: float = 0.344, tokens: float = 8.0) -> dict:
    return {"step": step, "trained": [[0, i, step, "g"] for i in range(groups)], "groups/zero_variance": equal,
            "reward/mean": reward, "tokens/completion_mean": tokens}


def test_a_collapsed_policy_is_named_every_ten_steps_while_it_lasts():
    """reasoning-gym's letter_counting on SmolLM2 from step 60 on: 31-32 of 32 groups equal, 8-token answers."""
    signal = Signal()
    said = [signal.add(_record(s, 31 if s % 3 else 32)) for s in range(60, 80)]
    assert said[:9] == [None] * 9 and said[10:19] == [None] * 9
    assert said[9] is not None and said[9].startswith("no learning signal in steps 60-69: 314 of 320 groups had one "
                                                      "reward for all their samples (reward 0.344, completions 8.0")
    assert said[19] is not None and "steps 70-79" in said[19]


def test_a_signal_in_a_tenth_of_the_groups_is_no_warning():
    signal = Signal()
    said = [signal.add(_record(s, 28)) for s in range(10)]  # 280 of 320 equal: 40 groups still teach
    assert said == [None] * 10
    said = [signal.add(_record(s, 29 if s < 5 else 28, reward=0.0)) for s in range(10, 20)]
    assert said == [None] * 10  # 285 of 320: under 90 %
    said = [signal.add(_record(s, 32, reward=0.0, tokens=64.0)) for s in range(20, 30)]
    assert said[-1] is not None and "320 of 320" in said[-1] and "(reward 0.000, completions 64.0" in said[-1]
