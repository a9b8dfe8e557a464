"""From rollout groups to padded micro-batches.

One row per sample: prompt + completion tokens, the behaviour log-probs of the completion, its loss mask
(1: sampled by the model; 0: put there by the environment, e.g. a tool's reply, generator/rollout.py), the
group advantage and the temperature it was sampled at. The loss covers the masked-in completion tokens only,
never the prompt. Groups with zero reward variance are skipped (counted). Rows are packed into micro-batches by
a token budget (rows x padded length).

A micro-batch is padded past its longest row to the next multiple of PAD_TO: every length the compiled layers see
(trainer.compile) is then a multiple of 8 with at least one padded position, which is what their compiled variants
are guarded on (the length's alignment; an attention mask that is None where no row is padded). Unpadded, a run
compiled each layer again for each new combination, 2-9 s a time, in its first steps (docs/figures.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner.health import entropy_positions
from learner.loss import group_advantages
from pipeline import protocol as P
from pipeline.staleness import behaviour_version, lag


@dataclass
class Row:
    prompt: np.ndarray
    completion: np.ndarray
    behaviour: np.ndarray
    mask: np.ndarray  # one per completion token: 1 trained, 0 not (the environment's)
    advantage: float
    temperature: float
    lag: int = 0  # of its group at the step
    prox: np.ndarray | None = None  # proximal log-probs of the completion (trainer.minibatches > 1, or m2po)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)


def build_rows(groups: list[P.RolloutGroup], step: int, scale_rewards: bool,
               overlong: tuple[int, int, float] = (0, 0, 0.0)) -> tuple[list[Row], dict]:
    """`overlong`: (max_tokens, buffer, penalty) of DAPO's soft overlong punishment (buffer 0: off)."""
    # a group's advantages are over its trajectories; an agent's trajectory split into several samples (each with the
    # context it was sampled from) gives each of them its advantage
    owners = [P.trajectory_of(g.samples) for g in groups]
    rewards = torch.tensor([P.trajectory_rewards(g.samples) for g in groups], dtype=torch.float64)
    sizes = [[0] * len(r) for r in rewards]  # tokens of each trajectory
    for gi, g in enumerate(groups):
        for t, s in zip(owners[gi], g.samples, strict=True):
            sizes[gi][t] += len(s.token_ids) // 4
    penalty = torch.tensor([[overlong_penalty(n, *overlong) for n in row] for row in sizes], dtype=torch.float64)
    adv, zero = group_advantages(rewards - penalty, scale=scale_rewards)
    rows = []
    for gi, g in enumerate(groups):
        if zero[gi]:
            continue
        prompt = P.unpack_ints(g.prompt_ids)
        for t, s in zip(owners[gi], g.samples, strict=True):
            tokens = P.unpack_ints(s.token_ids)
            if len(tokens):
                rows.append(Row(P.unpack_ints(s.prompt_ids) if s.prompt_ids else prompt, tokens,
                                P.unpack_floats(s.logprobs), P.unpack_mask(s.mask, len(tokens)), float(adv[gi, t]),
                                g.temperature, lag(g, step)))
    lags = [lag(g, step) for g in groups]
    samples = [s for g in groups for s in g.samples]
    turns = [P.unpack_ints(s.turns)[1::2] for s in samples if s.turns]
    lengths = [len(s.token_ids) // 4 for s in samples]
    stats = {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "reward/overlong_penalty": float(penalty.mean()),
        "groups/zero_variance": int(zero.sum()),
        "staleness/max_lag": max(lags), "staleness/mean_lag": float(np.mean(lags)),
        "staleness/min_behaviour_version": min(behaviour_version(g) for g in groups),
        "inflight/mixed_samples": sum(s.first_version < s.last_version for s in samples),
        "tokens/completion_mean": float(np.mean(lengths)), "tokens/completion_max": max(lengths),
        "samples/truncated": float(np.mean([s.finish_reason == "length" for s in samples])),
    }
    if any(s.turns or s.trajectory >= 0 for s in samples):  # an agent's
        stats |= {"agent/splits": len(samples) - sum(len(r) for r in rewards),
                  "agent/turns": sum(len(v) for v in turns),
                  "agent/version_changes": sum(int((np.diff(v) != 0).sum()) for v in turns),
                  "agent/failed": sum(s.finish_reason.startswith("agent_") for s in samples)}
    return rows, stats


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """0 up to max_tokens - buffer tokens, then rising linearly to `penalty` at max_tokens (DAPO)."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    return penalty * min(1.0, (length - (max_tokens - buffer)) / buffer)


PAD_TO = 8  # a micro-batch's length: its longest row's, rounded up past the next multiple of this


def padded(length: int) -> int:
    """The length of a micro-batch whose longest row has `length` tokens: a multiple of PAD_TO, with one padded
    position at least."""
    return (length // PAD_TO + 1) * PAD_TO


def micro_batches(rows: list[Row], token_budget: int) -> list[list[Row]]:
    """Greedy packing of length-sorted rows so that rows x padded longest <= token_budget (at least one row each)."""
    out: list[list[Row]] = []
    current: list[Row] = []
    longest = 0
    for row in sorted(rows, key=lambda r: r.length):
        new_longest = max(longest, padded(row.length))
        if current and (len(current) + 1) * new_longest > token_budget:
            out.append(current)
            current, new_longest = [], padded(row.length)
        current.append(row)
        longest = new_longest
    if current:
        out.append(current)
    return out


def collate(rows: list[Row], pad_id: int, device) -> dict:
    """Right-padded tensors (to `padded` length); position t of mask, mu, adv and prox describes token t+1."""
    L = padded(max(r.length for r in rows))
    n = len(rows)
    ids = torch.full((n, L), pad_id, dtype=torch.long)
    attn = torch.zeros((n, L), dtype=torch.long)
    mask = torch.zeros((n, L - 1))
    mu = torch.zeros((n, L - 1))
    adv = torch.zeros((n, L - 1))
    temp = torch.ones((n, 1, 1))
    prox = torch.zeros((n, L - 1))
    lags = torch.tensor([r.lag for r in rows], dtype=torch.long)
    for i, r in enumerate(rows):
        p, c = len(r.prompt), len(r.completion)
        ids[i, :p] = torch.from_numpy(r.prompt.astype(np.int64))
        ids[i, p:p + c] = torch.from_numpy(r.completion.astype(np.int64))
        attn[i, :p + c] = 1
        mask[i, p - 1:p + c - 1] = torch.from_numpy(r.mask.astype(np.float32))
        mu[i, p - 1:p + c - 1] = torch.from_numpy(r.behaviour.astype(np.float32))
        adv[i, p - 1:p + c - 1] = r.advantage
        temp[i] = r.temperature
        if r.prox is not None:
            prox[i, p - 1:p + c - 1] = torch.from_numpy(r.prox)
    out: dict = dict(input_ids=ids, attention_mask=attn, mask=mask, mu=mu, adv=adv, temperature=temp, lag=lags)
    if all(r.prox is not None for r in rows):
        out["prox"] = prox
    out["entropy_at"] = entropy_positions(mask)
    out = {k: v.to(device) if torch.is_tensor(v) else tuple(t.to(device) for t in v) for k, v in out.items()}
    out["first"] = min(len(r.prompt) for r in rows) - 1  # the first position that predicts a completion token
    out["unit_temperature"] = all(r.temperature == 1 for r in rows)
    return out
