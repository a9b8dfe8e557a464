"""A reward function for the chaos test: the echo reward, except that in a generator started with
CHAOS_REWARD_RAISES=N its Nth call raises (a user's reward function with a bug that shows up once)."""

from __future__ import annotations

import os

from pipeline.tasks import echo_reward

_calls = 0


def flaky_echo(prompts, completions, completion_ids=None, **columns):
    global _calls
    _calls += 1
    if _calls == int(os.environ.get("CHAOS_REWARD_RAISES", "0")):
        raise ZeroDivisionError("flaky_echo: a bug in the user's reward function")
    return echo_reward(prompts, completions, completion_ids, **columns)
