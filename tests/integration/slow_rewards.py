"""Reward functions that take their time: the echo reward a fifth of a second late for every group (a reward model
behind a slow endpoint), so that the rewards bind the run (tests/integration/test_verdict.py); and the echo reward
held while the file REWARD_GATE names exists, so that a generator holds its leases for as long as a test wants
(tests/integration/test_hosts.py). And one that rewards nothing, at once: no group has a learning signal
(test_verdict.py)."""

from __future__ import annotations

import os
import time

from pipeline.tasks import echo_reward

SLEEP_S = 0.2  # each call (one group); the generator scores a few groups at once, on its thread pool


def slow_echo(prompts, completions, completion_ids=None, **columns):
    time.sleep(SLEEP_S)
    return echo_reward(prompts, completions, completion_ids, **columns)


def gated_echo(prompts, completions, completion_ids=None, **columns):
    gate = os.environ.get("REWARD_GATE")
    while gate and os.path.exists(gate):
        time.sleep(0.05)
    return echo_reward(prompts, completions, completion_ids, **columns)


def nothing(prompts, completions, completion_ids=None, **columns):
    return [0.0] * len(completions)
