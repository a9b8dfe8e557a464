"""A rollout: what a generator does with one leased prompt to make its group of samples.

The generator calls the strategy `generator.rollout` names once per leased prompt; every strategy is a `Rollout`,
built once per run config (generator/spec.py `load_rollout`): a function (`module:function`) as a `FunctionRollout`,

    async def rollout(engine, prompt_ids: list[int], ctx: Context) -> list[Trajectory]   # ctx.n of them

or a class of this project's that runs more (builtin:agent's endpoint), which `aclose` stops.

A trajectory is every token after the prompt, with the behaviour log-prob of each and a loss mask: 1 for a token
the model sampled (trained), 0 for a token the environment put into the context (a tool's reply: the model reads
it, the loss leaves it out; its log-prob is 0). The learner trains on the mask (learner/batching.py). The
default, `single_turn`, is one completion per sample; generator/calculator.py is a two-turn example with a tool.
Rewards are computed afterwards from each trajectory's text (`text`, else its tokens decoded), by the reward
functions of the config, as TRL calls them (pipeline/tasks.py). `builtin:agent` (generator/agent.py) runs the user's
agent program against the generator's OpenAI-compatible endpoint; where an agent's history stopped extending what was
sampled, its trajectory is split into several `Trajectory` objects (`trajectory`: which one of the n they belong to,
`prompt_ids`: the context each was sampled from), which share the trajectory's reward.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline import protocol as P
from pipeline.tasks import TrainerState, score


class AgentFailed(Exception):
    """An agent hung or failed under generator.agent_failure requeue (generator/agent.py): the prompt is leased
    again (GroupFailed kind agent)."""


@dataclass
class Context:
    n: int  # samples in the group
    sampling: P.Sampling  # the lease's: max_tokens bounds every trajectory's tokens after the prompt
    tokenizer: Any  # the run's transformers tokenizer (its stubs type decode as str | list[str])
    item: P.PromptItem  # the prompt as leased (its text or messages, its dataset columns)
    seed: int | None = None  # the group's sampling seed (sampling.seed, the prompt); None: the engine's own


def seed_of(base: int | None, *parts: int) -> int | None:
    """A request's sampling seed from `base` (a run's sampling.seed, or a seed made from it) and the numbers that tell
    its requests apart; None where `base` is. vLLM seeds the n samples of one request base, base + 1, ..."""
    if base is None:
        return None
    digest = hashlib.blake2b(repr((base, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


@dataclass
class Trajectory:
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-probs; 0.0 for the environment's tokens
    mask: list[int]  # 1: sampled by the model (trained); 0: put there by the environment (not trained)
    finish_reason: str
    first_version: int  # weights version of its first sampled token
    last_version: int  # and of its last
    gen_ms: float = 0.0
    text: str | None = None  # the completion reward functions see (None: the tokens decoded)
    extra: dict = field(default_factory=dict)
    # an agent's (generator/agent.py): a trajectory split where its context stopped extending what came before
    prompt_ids: list[int] | None = None  # the context these tokens were sampled from, where it is not the prompt's
    trajectory: int = -1  # which of the group's n trajectories this is part of; -1: its index in the list
    turns: list[tuple[int, int]] = field(default_factory=list)  # (start in token_ids, version) of each model turn


class Rollout(Protocol):
    """A rollout strategy: the generator calls it once per leased prompt and closes it when the run's config
    replaces it, or at its exit."""

    async def __call__(self, engine: Any, prompt_ids: list[int], ctx: Context) -> list[Trajectory]: ...

    async def aclose(self) -> None:
        """Stop what it runs (an agent's endpoint and worker processes)."""
        ...


class FunctionRollout:
    """A rollout function as a Rollout: it runs nothing of its own to close."""

    def __init__(self, fn: Callable[[Any, list[int], Context], Awaitable[list[Trajectory]]]):
        self.fn = fn

    async def __call__(self, engine: Any, prompt_ids: list[int], ctx: Context) -> list[Trajectory]:
        return await self.fn(engine, prompt_ids, ctx)

    async def aclose(self) -> None:
        pass


async def single_turn(engine, prompt_ids: list[int], ctx: Context) -> list[Trajectory]:
    outs = await engine.generate(prompt_ids, ctx.n, ctx.sampling, seed=ctx.seed)
    return [Trajectory(o.token_ids, o.logprobs, [1] * len(o.token_ids), o.finish_reason, o.first_version,
                       o.last_version, o.gen_ms) for o in outs]


def score_group(outs: list[Trajectory], ctx: Context, rewards, total_steps: int) -> tuple[list, list]:
    """The group's rewards by the reward functions of the run: (totals, each function's) per sample. The samples a
    trajectory was split into share its reward, scored once from its first sample (an agent's answer is its text)."""
    tok, item = ctx.tokenizer, ctx.item
    owner = P.trajectory_of(outs)
    first = {t: i for i, t in reversed(list(enumerate(owner)))}
    heads = [outs[first[t]] for t in sorted(first)]
    texts = [o.text if o.text is not None else tok.decode(o.token_ids, skip_special_tokens=True) for o in heads]
    state = TrainerState(min(o.first_version for o in outs), total_steps, item.epoch)
    envs = [o.extra.get("environment") for o in heads]  # builtin:environment's instances (generator/environment.py)
    totals, per_fn = score(rewards, item.messages or item.prompt, texts, [o.token_ids for o in heads], item.columns,
                           state, {"environments": envs} if any(e is not None for e in envs) else None)
    for k, o in enumerate(heads):  # an agent that failed (generator/agent.py, agent_failure zero): reward 0
        if o.finish_reason.startswith("agent_"):
            totals[k], per_fn[k] = 0.0, [0.0] * len(per_fn[k])
    if len(heads) == len(outs):
        return totals, per_fn
    at = {t: k for k, t in enumerate(sorted(first))}
    return [totals[at[t]] for t in owner], [per_fn[at[t]] for t in owner]


def encode_group(outs: list[Trajectory], ctx: Context, lease: P.Lease, prompt_ids: list[int], scores: tuple,
                 generator_id: str, session: str) -> bytes:
    """The scored group encoded for the hub (RolloutGroup); `scores`: score_group's."""
    totals, per_fn = scores
    samples = [
        P.Sample(P.pack_ints(o.token_ids), P.pack_floats(o.logprobs), totals[i], per_fn[i], o.finish_reason,
                 o.first_version, o.last_version, o.gen_ms, b"" if all(o.mask) else P.pack_mask(o.mask),
                 P.pack_ints(o.prompt_ids) if o.prompt_ids is not None else b"", o.trajectory,
                 P.pack_ints([x for turn in o.turns for x in turn]) if o.turns else b"")
        for i, o in enumerate(outs)
    ]
    return P.encode(P.RolloutGroup(lease.lease_id, generator_id, ctx.item.prompt_id, ctx.item.epoch,
                                   P.pack_ints(prompt_ids), samples, lease.sampling.temperature, session))
