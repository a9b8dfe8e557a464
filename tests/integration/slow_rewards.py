"""A reward function for tests/integration/test_verdict.py: the echo reward, a fifth of a second late for every group
(a reward model behind a slow endpoint), so that the rewards bind the run."""

from __future__ import annotations

import time

from pipeline.tasks import echo_reward

SLEEP_S = 0.2  # each call (one group); the generator scores a few groups at once, on its thread pool


def slow_echo(prompts, completions, completion_ids=None, **columns):
    time.sleep(SLEEP_S)
    return echo_reward(prompts, completions, completion_ids, **columns)
