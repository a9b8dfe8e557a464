"""An example environment: the model may call a calculator once (`generator.rollout: generator.calculator:rollout`).

Turn 1: the model writes, and may end by writing "=" after an expression of digits and + or - (the tool call).
The calculator then puts the expression's value into the context (digits, a "-" for a negative value), and the
model goes on in turn 2. The tool's tokens are in the context and out of the loss (mask 0, log-prob 0); both
turns together stay within `sampling.max_tokens`. Written for the builtin tiny model's vocabulary (digits, "+",
"-", "="); a real model's tool would parse and answer its own format the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

from generator.rollout import Context, Trajectory, seed_of


async def rollout(engine, prompt_ids: list[int], ctx: Context) -> list[Trajectory]:
    tok = ctx.tokenizer
    eq = tok.convert_tokens_to_ids("=")
    first = await engine.generate(prompt_ids, ctx.n, ctx.sampling, seed=ctx.seed, stop=[eq])
    return list(await asyncio.gather(*(_finish(engine, prompt_ids, ctx, t, i) for i, t in enumerate(first))))


async def _finish(engine, prompt_ids: list[int], ctx: Context, turn, sample: int) -> Trajectory:
    tok = ctx.tokenizer
    ids, logprobs = list(turn.token_ids), list(turn.logprobs)
    traj = Trajectory(ids, logprobs, [1] * len(ids), turn.finish_reason, turn.first_version, turn.last_version,
                      turn.gen_ms)
    if not ids or ids[-1] != tok.convert_tokens_to_ids("="):
        return traj  # no tool call
    reply = tok(answer(tok.decode(ids[:-1])), add_special_tokens=False)["input_ids"]
    left = ctx.sampling.max_tokens - len(ids) - len(reply)
    traj.extra["tool"] = tok.decode(reply)
    if left <= 0:  # no room for the reply and an answer: the call stays unanswered
        return traj
    traj.token_ids += reply
    traj.logprobs += [0.0] * len(reply)
    traj.mask += [0] * len(reply)
    second_sampling = dataclasses.replace(ctx.sampling, max_tokens=left)
    (second,) = await engine.generate(prompt_ids + traj.token_ids, 1, second_sampling, seed=seed_of(ctx.seed, sample))
    traj.token_ids += second.token_ids
    traj.logprobs += second.logprobs
    traj.mask += [1] * len(second.token_ids)
    traj.finish_reason, traj.gen_ms = second.finish_reason, traj.gen_ms + second.gen_ms
    traj.first_version = min(traj.first_version, second.first_version)
    traj.last_version = max(traj.last_version, second.last_version)
    return traj


def answer(text: str) -> str:
    """The calculator: the value of the last expression of digits and + or - in `text`, spaced as the tiny
    tokenizer splits ("12" -> "1 2"); "0" when there is none."""
    terms = re.findall(r"[+-]?\s*\d+", text.replace(" ", ""))
    value = sum(int(t) for t in terms) if terms else 0
    return " ".join(str(value))
