"""A rollout that holds its generator's first group after its samples are in, as a group of very long completions
would, until it is cancelled (tests/integration/test_stale.py): every later group is the usual single turn. The held
group's prompt is written to the file ROLLOUT_HELD names, so that the test can find it trained later."""

from __future__ import annotations

import asyncio
import json
import os

from generator.rollout import single_turn

_held = False  # one generator process: its first group only


async def first_group_held(engine, prompt_ids, ctx):
    global _held
    outs = await single_turn(engine, prompt_ids, ctx)
    if not _held:
        _held = True
        with open(os.environ["ROLLOUT_HELD"], "w") as f:
            json.dump([ctx.item.epoch, ctx.item.prompt_id], f)
        await asyncio.sleep(600)  # until the generator stops it
    return outs
