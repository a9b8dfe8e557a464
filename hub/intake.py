"""Rollout intake: what the hub does with each group that comes back, and with a group a generator could not make.

Part of the hub (hub/hub.py), on its state under its lock. A rollout from a registered generator of its own lease is
checked (hub/validation.py) and buffered for the learner, or filtered (trainer.dynamic_sampling), or rejected
(counted by reason, its prompt leased again, and counted against its generator: hub/faults.py); an evaluation
round's is scored (hub/evaluation.py). A failed group (GroupFailed) costs the run what hub/faults.py decides.
"""

from __future__ import annotations

import threading

from hub.evaluation import Evaluation
from hub.faults import Faults
from hub.journal import Journal
from hub.ledger import Key, PromptLedger
from hub.membership import Membership
from hub.registry import GeneratorInfo, Registry
from hub.server import Server
from hub.validation import Expected, Rejected, RunShape, check_rollout
from pipeline import protocol as P
from pipeline.config import Config


class Intake:
    """Built by the hub over its parts, called under its lock; the newest version published comes with each rollout.
    A generator whose rollouts are rejected too often is dropped through `membership`."""

    def __init__(self, cfg: Config, shape: RunShape, registry: Registry, ledger: PromptLedger, evaluation: Evaluation,
                 faults: Faults, membership: Membership, server: Server, journal: Journal, counters: dict[str, int],
                 lock: threading.Condition) -> None:
        self.cfg, self.shape, self.registry, self.ledger, self.evaluation = cfg, shape, registry, ledger, evaluation
        self.faults, self.membership, self.server, self.journal = faults, membership, server, journal
        self.counters, self.lock = counters, lock

    def rollout(self, msg: P.RolloutGroup, user: str, published: int) -> None:
        """A group as the server hands it over (hub/server.py, Handler.rollout); `published`: the newest version
        announced, which no engine can be past."""
        key = (msg.epoch, msg.prompt_id)
        gen, reason, detail = self.registry.sender(msg, user)
        if gen is None:
            self.reject(reason, detail, msg.generator_id)
            return
        gen.received += 1
        try:
            self._received(msg, gen, key, published)
        finally:
            self.membership.left_when_in(gen)

    def _received(self, msg: P.RolloutGroup, gen: GeneratorInfo, key: Key, published: int) -> None:
        """A rollout of a registered generator, under the lock: scored (evaluation), buffered, or refused."""
        self.registry.progressed(gen)  # a group came back (valid or not): its engine runs
        if self.evaluation.owns(msg.lease_id):  # scored, not trained (hub/evaluation.py)
            try:
                self.evaluation.received(msg, gen.generator_id, published)
            except Rejected as e:
                self.reject(e.reason, e.detail, gen.generator_id)
                self._count_against(gen, f"{e.reason}: {e.detail}")
            self.lock.notify_all()
            return
        lease = self.ledger.leases.get(msg.lease_id)
        if lease is None or key not in lease.items:
            name = "duplicates" if self.ledger.done(key) or self.ledger.is_buffered(key) else "unknown_lease"
            self.counters[name] += 1
            self.journal.warn(name, "hub: dropped rollout for prompt %s of %s lease %d (%s)", key,
                       "a known" if lease else "an unknown", msg.lease_id, name)
            return
        if lease.generator_id != gen.generator_id:
            self.reject("lease", f"rollout for prompt {key} of lease {msg.lease_id}, which is leased to "
                                  "another generator", gen.generator_id)
            self._count_against(gen, f"lease: a rollout for lease {msg.lease_id} of another generator")
            return
        expected = Expected(lease.items[key].prompt_ids, lease.temperature, lease.min_version)
        self.ledger.settle(msg.lease_id, key)
        try:
            check_rollout(msg, expected, published, self.shape)
        except Rejected as e:
            self.ledger.requeue([key])  # its prompt is leased again
            self.reject(e.reason, e.detail, gen.generator_id)
            self._count_against(gen, f"{e.reason}: {e.detail}")
            self.lock.notify_all()
            return
        for s in msg.samples:  # an agent that hung or raised: its sample scored as generator.agent_failure says
            if s.finish_reason.startswith("agent_"):
                self.counters[f"agent/{s.finish_reason}"] = self.counters.get(f"agent/{s.finish_reason}", 0) + 1
                self.journal.event("agent_failed", gen.principal, generator=gen.generator_id, prompt_id=msg.prompt_id,
                                   reason=s.finish_reason)
        filtered = self.cfg.trainer.dynamic_sampling and len(set(P.trajectory_rewards(msg.samples))) == 1
        if filtered:
            self.ledger.filter(msg)  # no signal: done for its epoch, a fresh group takes its place
        else:
            self.ledger.buffered(msg)
        tokens = sum(len(s.token_ids) // 4 for s in msg.samples)
        self.counters["rollouts"] += 1
        self.counters["tokens"] += tokens
        gen.groups += 1
        gen.tokens += tokens
        if filtered or not self.ledger.leases or len(self.ledger.buffer) >= self.cfg.trainer.batch_size:
            # the learner may have a batch now, or the dataset may have ended: woken for each group instead, it
            # went through the whole buffer each time (with 1,024 generators, most of the hub's time)
            self.lock.notify_all()

    def _count_against(self, gen: GeneratorInfo, why: str) -> None:
        """A rollout of `gen`'s own lease was invalid: past hub.max_rejected_rollouts it is quarantined."""
        if self.faults.rejected_rollout(gen, why):
            self.membership.drop(gen.generator_id, "quarantined", why)

    def group_failed(self, msg: P.GroupFailed, gen: GeneratorInfo, version: int) -> P.Message:
        """A generator could not generate a leased prompt: hub/faults.py decides what it costs. One it stopped as
        stale (`version` has passed its samples' by more than k) is leased again and costs nothing, unless the lease
        refutes it (refused: counted, a strike)."""
        key = (msg.epoch, msg.prompt_id)
        if self.evaluation.owns(msg.lease_id):
            return P.Ack(known=self.evaluation.failed(msg.lease_id, msg.prompt_id, msg.generator_id))
        lease = self.ledger.leases.get(msg.lease_id)
        if lease is None or lease.generator_id != msg.generator_id or key not in lease.items:
            return P.Ack(known=False)
        if msg.kind not in ("engine", "prompt", "reward", "agent", "stale"):
            return self.membership.refuse(f"GroupFailed.kind: {msg.kind!r} is not engine, prompt, reward, agent or "
                                          "stale")
        k = self.cfg.trainer.max_staleness
        if msg.kind == "stale" and version - lease.min_version <= k:  # its groups start at min_version or later
            return self.membership.refuse(
                f"GroupFailed.kind stale: lease {msg.lease_id}'s groups start at version {lease.min_version} or "
                f"later, within trainer.max_staleness={k} of version {version}: they can still be trained")
        self.ledger.settle(msg.lease_id, key)
        self.registry.progressed(gen)
        if msg.kind == "stale":  # no step can train it any more: leased again at once, no one's fault
            self.ledger.requeue([key])
            self.counters["stale_stopped"] += 1
        else:
            self.faults.group_failed(msg, gen.principal)
        self.lock.notify_all()
        return P.Ack()

    def reject(self, reason: str, detail: str, gen_id: str) -> None:
        """A rollout that is not trained: counted by reason, logged (rate limited), named in the detail."""
        self.counters["rejected_rollouts"] += 1
        self.counters[f"rejected/{reason}"] = self.counters.get(f"rejected/{reason}", 0) + 1
        self.server.strike()
        self.journal.warn(f"rejected/{reason}", "hub: rejected a rollout from %s (%s): %s", gen_id, reason, detail)

