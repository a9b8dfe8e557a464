"""What a rollout says, checked against the run before it enters the buffer.

The codec (pipeline/protocol.py) guarantees types and sizes; this module checks meaning. A group is
trained only if its prompt is the one leased (same token ids), every token id lies in the model's
vocabulary, it has the run's number of samples, completions fit `sampling.max_tokens` and prompt +
completion fit `generator.max_model_len`, behaviour log-probs are finite and <= 0, rewards are finite
(a reward function's None travels as NaN in `rewards` and is left out of the total), versions lie
between the lease's minimum and the learner's current version, and the temperature is the lease's.
Whose lease it is (the sender's own) is the hub's check. A failed check raises `Rejected` with a short
reason (the counter's name: `rejected/<reason>`) and a detail naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline import protocol as P


@dataclass(frozen=True)
class RunShape:
    vocab_size: int  # rows of the model's embedding: token ids must lie in [0, vocab_size)
    group_size: int
    max_tokens: int
    max_model_len: int
    rewards: int  # reward functions: each sample carries one unweighted value per function


@dataclass(frozen=True)
class Expected:
    """What the lease said about one prompt."""

    prompt_ids: bytes
    temperature: float
    min_version: int


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def check_rollout(group: P.RolloutGroup, expected: Expected, version: int, shape: RunShape) -> None:
    where = f"RolloutGroup(prompt_id={group.prompt_id})"
    try:
        P.check_shape(group, shape.group_size)
    except P.ProtocolError as e:
        raise Rejected("samples" if "group size" in str(e) else "structure", str(e)) from None
    if group.prompt_ids != expected.prompt_ids:
        raise Rejected("prompt", f"{where}.prompt_ids: not the token ids of the leased prompt")
    if group.temperature != expected.temperature:
        raise Rejected("temperature", f"{where}.temperature: {group.temperature!r}, the lease said "
                                      f"{expected.temperature!r}")
    prompt_len = len(group.prompt_ids) // 4
    plain = not any(s.prompt_ids or s.turns or s.trajectory >= 0 for s in group.samples)
    if plain and _clean(group.samples, prompt_len, expected.min_version, version, shape):
        return
    for i, s in enumerate(group.samples):  # something is wrong, or an agent's samples: which sample, and what
        _check_sample(s, f"{where}.samples[{i}]", prompt_len, expected.min_version, version, shape)
    _check_trajectories(group.samples, where)


def _clean(samples: list[P.Sample], prompt_len: int, min_version: int, version: int, shape: RunShape) -> bool:
    """Every check of `_check_sample` over the whole group at once (a few array operations for the group, not for
    each sample: the hub validates thousands of groups a second). False: some sample fails, `_check_sample` says
    which and why. It may be stricter than `_check_sample`, never laxer (tests/unit/test_hub_trust.py)."""
    longest = max(len(s.token_ids) for s in samples) // 4
    if longest > shape.max_tokens or prompt_len + longest > shape.max_model_len:
        return False
    tokens = P.unpack_ints(b"".join(s.token_ids for s in samples))
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= shape.vocab_size):
        return False
    logprobs = P.unpack_floats(b"".join(s.logprobs for s in samples))
    if len(logprobs) and not (logprobs.min() > -math.inf and logprobs.max() <= 0):  # NaN fails both
        return False
    for s in samples:
        if not (math.isfinite(s.reward) and math.isfinite(s.gen_ms) and len(s.rewards) == shape.rewards
                and min_version <= s.first_version <= s.last_version <= version
                and not any(math.isinf(r) for r in s.rewards)):
            return False
    return True


def _check_sample(s: P.Sample, where: str, prompt_len: int, min_version: int, version: int, shape: RunShape) -> None:
    if s.prompt_ids:  # an agent's sample with a context of its own
        own = P.unpack_ints(s.prompt_ids)
        if own.min() < 0 or own.max() >= shape.vocab_size:
            raise Rejected("token_id", f"{where}.prompt_ids: {int(own[(own < 0) | (own >= shape.vocab_size)][0])} "
                                       f"lies outside the vocabulary [0, {shape.vocab_size})")
        prompt_len = len(own)
    tokens = P.unpack_ints(s.token_ids)
    if len(tokens) > shape.max_tokens:
        raise Rejected("length", f"{where}: {len(tokens)} completion tokens, sampling.max_tokens is {shape.max_tokens}")
    if prompt_len + len(tokens) > shape.max_model_len:
        raise Rejected("length", f"{where}: prompt + completion of {prompt_len + len(tokens)} tokens, "
                                 f"generator.max_model_len is {shape.max_model_len}")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= shape.vocab_size):
        bad: int | float = int(tokens[(tokens < 0) | (tokens >= shape.vocab_size)][0])
        raise Rejected("token_id", f"{where}.token_ids: {bad} lies outside the vocabulary [0, {shape.vocab_size})")
    logprobs = P.unpack_floats(s.logprobs)
    if not np.isfinite(logprobs).all() or (logprobs > 0).any():
        bad = float(logprobs[~np.isfinite(logprobs) | (logprobs > 0)][0])
        raise Rejected("logprob", f"{where}.logprobs: {bad!r}; behaviour log-probs must be finite and <= 0")
    if not np.isfinite(s.reward):
        raise Rejected("reward", f"{where}.reward: {s.reward!r} is not finite")
    if len(s.rewards) != shape.rewards or np.isinf(s.rewards).any():
        raise Rejected("reward", f"{where}.rewards: {s.rewards!r}; expected {shape.rewards} values, each finite "
                                 "or NaN (None)")
    if not (min_version <= s.first_version <= s.last_version <= version):
        raise Rejected("version", f"{where}: versions {s.first_version}..{s.last_version} outside "
                                  f"[{min_version}, {version}] (the lease's minimum, the learner's current)")
    if not np.isfinite(s.gen_ms):
        raise Rejected("structure", f"{where}.gen_ms: {s.gen_ms!r} is not finite")
    turns = P.unpack_ints(s.turns).reshape(-1, 2)
    if len(turns) and not ((np.diff(turns[:, 0]) > 0).all() and turns[0, 0] >= 0 and turns[-1, 0] < len(tokens)
                           and (turns[:, 1] >= s.first_version).all() and (turns[:, 1] <= s.last_version).all()):
        raise Rejected("version", f"{where}.turns: {turns.tolist()[:8]}; each model turn's start must rise within "
                                  f"the {len(tokens)} tokens, its version lie in {s.first_version}..{s.last_version}")


def _check_trajectories(samples: list[P.Sample], where: str) -> None:
    """The samples a trajectory was split into carry its one reward."""
    seen: dict[int, P.Sample] = {}
    for i, (t, s) in enumerate(zip(P.trajectory_of(samples), samples, strict=True)):
        first = seen.setdefault(t, s)
        if s.reward != first.reward or not np.array_equal(s.rewards, first.rewards, equal_nan=True):
            raise Rejected("reward", f"{where}.samples[{i}]: reward {s.reward!r}, another sample of trajectory {t} "
                                     f"has {first.reward!r}; the samples of a trajectory share its reward")


def check_prompt_ids(ids: np.ndarray, vocab_size: int) -> None:
    """The hub's own tokenisation of a leased prompt (a tokenizer larger than the model's embedding)."""
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise Rejected("token_id", f"the tokenizer gives ids outside the model's vocabulary [0, {vocab_size})")


def check_stages(stage_s: dict) -> str:
    """Why a heartbeat's stage_s (seconds per generator stage, pipeline/trace.py) cannot be kept ("" when it can):
    a name outside protocol.STAGES, or seconds that are not a finite number >= 0."""
    for name, seconds in stage_s.items():
        if name not in P.STAGES:
            return f"stage_s: {name!r} is not one of {', '.join(P.STAGES)}"
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds < 0:
            return f"stage_s[{name!r}]: {seconds!r}; seconds must be a finite number >= 0"
    return ""
