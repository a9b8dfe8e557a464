"""Faults that could end the run, counted only when confirmed: prompts no engine takes, reward functions that raise.

A generator reports a group it could not make (GroupFailed): "engine" (lease it again, a few times), "prompt"
(vLLM refused the prompt itself), "reward" (a reward function raised: an error of the run, not of the prompt).
The prompt goes to another generator while one is there to try it; the fault counts once confirmed by two
principals or by every registered one (hub/registry.py): a confirmed "prompt" (or a third "engine") rejects
the prompt for the epoch, a confirmed "reward" counts toward hub.max_reward_errors. Past hub.max_rejected_prompts
or hub.max_reward_errors the run stops with the reason (`fail`). A generator whose own rollouts keep being rejected
is quarantined (`rejected_rollout`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hub.journal import Journal
from hub.ledger import Key, PromptLedger
from hub.registry import GeneratorInfo, Registry
from pipeline import protocol as P
from pipeline.config import Config

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # a prompt whose group failed this often in engines is rejected like an invalid one


class Faults:
    def __init__(self, cfg: Config, ledger: PromptLedger, registry: Registry, journal: Journal,
                 counters: dict[str, int], fail: Callable[[str], None]) -> None:
        self.cfg, self.ledger, self.registry, self.journal, self.counters = cfg, ledger, registry, journal, counters
        self.fail = fail  # callable(why): the run cannot go on
        self.confirmed_reward_errors = 0  # reward errors every principal that could try agreed on

    def group_failed(self, msg: P.GroupFailed, principal: str) -> None:
        """The group of a prompt leased to the sender failed (its lease entry is settled already)."""
        key = (msg.epoch, msg.prompt_id)
        attempts, tried = self.ledger.failed(key, principal)
        confirmed = self.registry.confirmed(tried)
        if msg.kind == "agent":  # generator.agent_failure requeue: leased again, as an engine's failure is
            self.counters["agent/requeued"] = self.counters.get("agent/requeued", 0) + 1
            self.journal.event("agent_failed", principal, generator=msg.generator_id, prompt_id=msg.prompt_id,
                               reason=msg.reason[:500])
        if msg.kind == "reward":
            self._reward_error(key, msg, confirmed)
        elif confirmed and (msg.kind == "prompt" or attempts >= MAX_ATTEMPTS):
            self.reject_prompt(key, msg.generator_id, msg.reason)
        else:
            self.ledger.requeue([key])
            self.journal.warn("failed", "hub: prompt %s failed on %s (%s: %s); leased again", key, msg.generator_id,
                              msg.kind, msg.reason[:500])

    def reject_prompt(self, key: Key, by: str, reason: str) -> None:
        self.counters["rejected_prompts"] += 1
        self.ledger.reject(key)  # done for its epoch, its fault memory forgotten
        self.journal.event("prompt_rejected", "" if by == "hub" else self.registry.principal_of(by), generator=by,
                           epoch=key[0], prompt_id=key[1], reason=reason)
        self.journal.warn("prompt_rejected", "hub: prompt %s rejected (%s): %s", key, by, reason)
        limit = self.cfg.hub.max_rejected_prompts
        if self.counters["rejected_prompts"] >= limit:
            self.fail(f"{limit} prompts were rejected (hub.max_rejected_prompts), the last, prompt {key[1]}: "
                      f"{reason}. Check data.prompt_column, the tokenizer and generator.max_model_len")

    def rejected_rollout(self, gen: GeneratorInfo, why: str) -> bool:
        """A rollout of `gen`'s own lease was invalid. Past hub.max_rejected_rollouts in one registration its
        principal is quarantined (True: the hub drops it, its leases re-queued) and refused for hub.quarantine_s,
        so a faulty or compromised generator cannot keep taking prompts from the window to return them invalid."""
        gen.rejected += 1
        if gen.rejected < self.cfg.hub.max_rejected_rollouts:
            return False
        until = self.registry.quarantine(gen.principal, self.cfg.hub.quarantine_s,
                                         f"{gen.rejected} of its rollouts were rejected, the last: {why}")
        log.error("hub: generator %s quarantined for %.0f s: %d of its rollouts were rejected, the last: %s",
                  gen.generator_id, until, gen.rejected, why)
        self.counters["quarantined"] = self.counters.get("quarantined", 0) + 1
        self.journal.event("quarantine", gen.principal, generator=gen.generator_id, key=gen.user.split(":", 1)[-1],
                           seconds=until, rejected=gen.rejected, reason=why)
        return True

    def _reward_error(self, key: Key, msg: P.GroupFailed, confirmed: bool) -> None:
        self.ledger.requeue([key])
        self.counters["reward_errors"] += 1
        self.journal.event("reward_error", self.registry.principal_of(msg.generator_id), generator=msg.generator_id,
                           epoch=key[0], prompt_id=key[1], error=msg.reason, confirmed=confirmed)
        self.journal.warn("reward_error", "hub: a reward function failed in %s on prompt %s:\n%s", msg.generator_id,
                          key, msg.reason)
        if not confirmed:  # another generator tries the prompt first
            return
        self.ledger.forgive(key)  # the prompt is not at fault: anyone may take it again
        self.confirmed_reward_errors += 1
        limit = self.cfg.hub.max_reward_errors
        if self.confirmed_reward_errors >= limit:
            self.fail(f"reward functions raised {self.confirmed_reward_errors} times (hub.max_reward_errors="
                      f"{limit}); the last, on prompt {key[1]} in {msg.generator_id}:\n{msg.reason}")
