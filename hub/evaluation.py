"""Evaluation during training (eval.every > 0): the held-out prompts, sampled by the generators at a version.

When the step that makes version v ends with v a multiple of eval.every, a round starts: each held-out prompt
is leased once (eval.samples samples at eval.temperature, min_version v), outside the staleness admission
(hub/leases.py): first while the groups buffered beyond the learner's next batch hold as many samples as the round
has left to sample (the learner is fed while the round takes its engine time), else
in the time the engines have no training to do: a generator gets a round's prompts when the staleness window has no
room for it, at most generator.lease_size of them in flight at once while training goes on, so they share its engine
with a batch the learner waits for only that much (a round of 128 prompts x 4 samples of 256 tokens beside the first
batch made it take 3.7 s where 1.4 s was the engine's own time: docs/figures.md, "Every GPU busy"). A round that is
overdue (the next round has started) takes turns with training instead, so none falls behind for good. What comes back
is checked like a training rollout, then scored here, not trained:

    eval/reward_mean   the mean reward over every sample (avg@k)
    eval/pass@k        the fraction of prompts with a sample whose reward reaches eval.pass_threshold
    eval/pass@1        the same per sample (the unbiased pass@1 estimate)
    eval/behaviour_version   the oldest weights version that sampled the round (v, or later if v was gone)
    eval/newest_version      the newest: with generator.update_mode inflight, a request that runs while a version
                             arrives ends under it, so a round labelled v may hold tokens of v + 1, v + 2, ...
    eval/mixed_samples       samples whose tokens came from more than one version (0 in generator.lora_mode adapter,
                             where a request keeps its adapter)

A lease lost with its generator, or not returned in time, goes back to its round; a prompt whose group failed
is left out of it (eval/failed). A round ends when every prompt is in; it is written to RUN_DIR/eval.jsonl and
reported with the learner's next step (`done`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hub.prompts import Prompts
from hub.validation import Expected, Rejected, RunShape, check_rollout
from pipeline import protocol as P
from pipeline.config import Config

EPOCH = -1  # the epoch of an evaluation prompt: never one of training's


@dataclass
class Round:
    version: int
    pending: list[int]
    rewards: dict[int, list[float]] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)  # per group: the oldest version of its tokens
    newest: int = -1  # the newest version of any token of the round
    mixed: int = 0  # samples whose first and last tokens came from different versions
    failed: int = 0
    started: float = field(default_factory=time.monotonic)


@dataclass
class EvalLease:
    lease_id: int
    generator_id: str
    round: Round
    items: dict[int, P.PromptItem]
    granted: float = field(default_factory=time.monotonic)


class Evaluation:
    def __init__(self, cfg: Config, prompts: Prompts, shape: RunShape, run_dir: Path) -> None:
        self.cfg, self.prompts, self.run_dir = cfg.eval, prompts, run_dir
        self.shape = RunShape(shape.vocab_size, cfg.eval.samples, shape.max_tokens, shape.max_model_len, shape.rewards)
        s = cfg.sampling
        self.sampling = P.Sampling(s.max_tokens, cfg.eval.temperature, s.top_p, s.ignore_eos)
        self.rounds: list[Round] = []
        self.leases: dict[int, EvalLease] = {}
        self.finished: list[dict] = []  # rounds done, not yet reported with a step
        self.turn = False  # an overdue round's next lease request tries its prompts first (hub/leases.py)

    def start(self, version: int) -> None:
        if self.cfg.every and version % self.cfg.every == 0 and len(self.prompts):
            self.rounds.append(Round(version, list(range(min(self.cfg.max_prompts, len(self.prompts))))))

    def _oldest(self) -> Round | None:
        """The oldest round with prompts left."""
        return next((r for r in self.rounds if r.pending), None)

    def overdue(self, version: int) -> bool:
        """Whether the oldest round with prompts left is eval.every versions old or more (the next one has started)."""
        rnd = self._oldest()
        return rnd is not None and version - rnd.version >= self.cfg.every

    def owed(self) -> int:
        """Samples of the oldest round with prompts left that no lease holds yet."""
        rnd = self._oldest()
        return len(rnd.pending) * self.cfg.samples if rnd is not None else 0

    def held(self, generator_id: str) -> int:
        """Prompts of evaluation leases `generator_id` holds."""
        return sum(len(lease.items) for lease in self.leases.values() if lease.generator_id == generator_id)

    def lease(self, lease_id: int, generator_id: str, n: int) -> P.Lease | None:
        """Up to n prompts of the oldest round with prompts left, or None."""
        rnd = self._oldest()
        if rnd is None or n <= 0:
            return None
        items: dict[int, P.PromptItem] = {}
        while rnd.pending and len(items) < n:
            pid = rnd.pending.pop(0)
            try:
                items[pid] = self.prompts.item(EPOCH, pid)
            except Rejected:
                rnd.failed += 1  # a prompt no engine can take
        if not items:
            self._maybe_done(rnd)
            return None
        self.leases[lease_id] = EvalLease(lease_id, generator_id, rnd, items)
        return P.Lease(lease_id, rnd.version, list(items.values()), self.sampling, self.cfg.samples, eval=True)

    def leases_of(self, generator_id: str) -> set[int]:
        return {lease.lease_id for lease in self.leases.values() if lease.generator_id == generator_id}

    def owns(self, lease_id: int) -> bool:
        return lease_id in self.leases

    def received(self, msg: P.RolloutGroup, generator_id: str, version: int) -> None:
        """A group for an evaluation lease, scored; Rejected if it is not valid (its prompt is asked again)."""
        lease = self.leases[msg.lease_id]
        if lease.generator_id != generator_id or msg.prompt_id not in lease.items:
            raise Rejected("lease", f"evaluation rollout for prompt {msg.prompt_id} of lease {msg.lease_id}, which "
                                    "is not the sender's or does not hold it")
        item = lease.items.pop(msg.prompt_id)
        if not lease.items:
            del self.leases[msg.lease_id]
        try:
            check_rollout(msg, Expected(item.prompt_ids, self.sampling.temperature, lease.round.version), version,
                          self.shape)
        except Rejected:
            lease.round.pending.append(msg.prompt_id)  # asked again
            raise
        lease.round.rewards[msg.prompt_id] = P.trajectory_rewards(msg.samples)
        lease.round.versions.append(min(s.first_version for s in msg.samples))
        lease.round.newest = max(lease.round.newest, *(s.last_version for s in msg.samples))
        lease.round.mixed += sum(s.first_version != s.last_version for s in msg.samples)
        self._maybe_done(lease.round)

    def failed(self, lease_id: int, prompt_id: int, generator_id: str) -> bool:
        """The sender could not generate a prompt of its evaluation lease: left out of the round. False (and
        nothing changes) when the lease is another generator's or does not hold the prompt."""
        lease = self.leases[lease_id]
        if lease.generator_id != generator_id or lease.items.pop(prompt_id, None) is None:
            return False
        lease.round.failed += 1
        if not lease.items:
            del self.leases[lease_id]
        self._maybe_done(lease.round)
        return True

    def take_back(self, generator_id: str | None = None, older_than: float | None = None) -> int:
        """Leases of a generator that is gone, or not returned within `older_than` seconds, back to their rounds."""
        now, n = time.monotonic(), 0
        for lease in list(self.leases.values()):
            if lease.generator_id == generator_id or (older_than is not None and now - lease.granted > older_than):
                lease.round.pending[:0] = list(lease.items)
                n += len(lease.items)
                del self.leases[lease.lease_id]
        return n

    def busy(self) -> bool:
        return bool(self.rounds)

    def done(self) -> list[dict]:
        out, self.finished = self.finished, []
        return out

    def _maybe_done(self, rnd: Round) -> None:
        if rnd.pending or any(lease.round is rnd for lease in self.leases.values()) or rnd not in self.rounds:
            return
        self.rounds.remove(rnd)
        rewards = np.array([r for r in rnd.rewards.values()], dtype=np.float64).reshape(-1, self.cfg.samples)
        passed = rewards >= self.cfg.pass_threshold
        k = self.cfg.samples
        record = {
            "version": rnd.version, "eval/prompts": len(rewards), "eval/failed": rnd.failed,
            "eval/reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
            f"eval/pass@{k}": float(passed.any(axis=1).mean()) if len(rewards) else float("nan"),
            "eval/pass@1": float(passed.mean()) if len(rewards) else float("nan"),
            "eval/behaviour_version": min(rnd.versions, default=rnd.version),
            "eval/newest_version": max(rnd.newest, rnd.version), "eval/mixed_samples": rnd.mixed,
            "eval/seconds": time.monotonic() - rnd.started,
        }
        with (self.run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.finished.append(record)
