"""A generator's life at the hub: the run's spec, registration, heartbeats, weights applied, leaving and being dropped.

Part of the hub (hub/hub.py), on its state under its lock. A generator first asks for the run's spec (SpecRequest),
refused for good where its claims, model files or code say it cannot serve the run; then registers (Register),
refused where its spec digest, fingerprints or contents are not the run's, or a version it says it holds was never
published. A heartbeat and a WeightsApplied may only name versions the hub published. A generator that leaves before
its last rollouts arrived goes once they are in (LEAVE_GRACE_S at most); one dropped (it left, went silent,
re-registers, was quarantined) has its leased prompts leased again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hub.evaluation import Evaluation
from hub.journal import Journal
from hub.leases import LeaseDesk
from hub.ledger import PromptLedger
from hub.registry import GENERATOR_ID, GeneratorInfo, Registry
from hub.server import Server
from hub.serving import WeightServing
from hub.validation import check_stages
from pipeline import pinning, runspec
from pipeline import protocol as P
from pipeline.config import Config

log = logging.getLogger(__name__)


LEAVE_GRACE_S = 10.0  # how long a leaving generator's last rollouts are waited for


class Membership:
    """Built by the hub over its parts, called under its lock; the hub's version (trained) comes with each call that
    needs it. `fingerprints` and `contents`: the learner's (Hub's arguments), which every generator's must be."""

    def __init__(self, cfg: Config, run_id: str, fingerprints: dict[str, str], contents: dict[str, str],
                 rollouts_address: str, registry: Registry, weights: WeightServing, ledger: PromptLedger,
                 evaluation: Evaluation, desk: LeaseDesk, server: Server, journal: Journal, counters: dict[str, int],
                 lock: threading.Condition, sampling: Callable[[], P.Sampling]) -> None:
        self.cfg, self.run_id, self.fingerprints, self.contents = cfg, run_id, fingerprints, contents
        self.spec_digest = runspec.digest(cfg)  # what every generator serves: the run-time knobs aside, fixed
        self.rollouts_address = rollouts_address  # where a Welcome tells a generator to push its rollouts
        self.registry, self.weights, self.ledger, self.evaluation = registry, weights, ledger, evaluation
        self.desk, self.server, self.journal, self.counters, self.lock = desk, server, journal, counters, lock
        self.sampling = sampling  # () -> the run's P.Sampling, as the run-time knobs are now

    def register(self, msg: P.Register, ident: bytes, user: str, version: int) -> P.Message:
        refusal, forged = self.registry.refusal(msg, user)
        if refusal:
            return self.refuse(refusal) if forged else P.Error(refusal, stop=True)
        if why := self._serves_another(msg.spec_digest, msg.fingerprints, msg.contents):
            return self._refuse_spec(msg.generator_id, user, why)
        if msg.loaded_run == self.run_id and (why := self._unpublished(msg.loaded_version, -1, version)):
            return P.Error(f"registration refused: loaded_version {why}", stop=True)
        old = self.registry.generators.get(msg.generator_id)
        if old is not None:  # a reconnect under the same id, with its session
            self.weights.leave(old.generator_id, again=True)
            self.drop(msg.generator_id, "re-registered")
        try:
            transport, collective = self.weights.join(msg, ident, version)
        except ValueError as e:
            return P.Error(str(e), fatal=True)
        loaded = msg.loaded_version if msg.loaded_run == self.run_id else -1  # weights of another run: reloaded
        gen = self.registry.add(msg, ident, user, transport, loaded, self.weights.on_learner_gpus(msg))
        last = self.weights.last_ready
        self.journal.event("register", gen.principal, generator=gen.generator_id, host=gen.host, gpus=gen.gpus,
                           transport=transport, key=user.split(":", 1)[-1], version=version,
                           weights=version if collective is not None or last is None else last.version)
        return P.Welcome(
            run_id=self.run_id, generator_id=gen.generator_id, version=version,
            rollouts_endpoint=self.rollouts_address, transport=transport, heartbeat_s=self.cfg.hub.heartbeat_s,
            sampling=self.sampling(), group_size=self.cfg.trainer.group_size, index=gen.index,
            collective=collective, session=gen.session)

    def spec_request(self, msg: P.SpecRequest, user: str) -> P.Message:
        """The run's spec, unless the generator's claims, fingerprints or a problem it reports say it cannot serve
        the run (refused and counted, naming the field)."""
        if not GENERATOR_ID.fullmatch(msg.generator_id):
            return self.refuse(f"SpecRequest: generator_id {msg.generator_id[:40]!r}")
        if why := self.registry.quarantined(user or msg.generator_id):
            return P.Error(f"registration refused: {why}", stop=True)
        why = (runspec.conflict(msg.claims, self.cfg) or msg.problem
               or (runspec.fingerprint_conflict(msg.fingerprints, self.fingerprints) if msg.fingerprints else ""))
        if why:
            return self._refuse_spec(msg.generator_id, user, why)
        return P.RunSpec(self.run_id, runspec.spec_of(self.cfg), self.spec_digest, self.fingerprints, self.contents)

    def _serves_another(self, digest: str, fingerprints: dict[str, str], contents: dict[str, str]) -> str:
        """Why a registering generator does not serve this run's config ("" when it does): another config, other
        model files, or other code or files under the names the config gives (a generator checks those itself when
        it adopts the spec; this catches one that did not)."""
        if digest != self.spec_digest:
            return (f"it serves another config than the run's (spec digest {digest[:16] or 'none'}, the run's "
                    f"{self.spec_digest[:16]}): a generator adopts the run's (SpecRequest) before it registers")
        return (runspec.fingerprint_conflict(fingerprints, self.fingerprints)
                or pinning.content_conflict(contents, self.contents, self.cfg))

    def _refuse_spec(self, gen_id: str, user: str, why: str) -> P.Error:
        """A generator that cannot serve this run's config: refused for good (it exits), counted, journaled."""
        self.counters["refused_spec"] += 1
        self.journal.event("spec_refused", user or gen_id, generator=gen_id, reason=why)
        self.journal.warn("spec_refused", "hub: generator %s refused: %s", gen_id, why)
        return P.Error(f"registration refused: {why}", stop=True)

    def _unpublished(self, version: int, lowest: int, trained: int) -> str:
        """Why a version a generator reports cannot be one it holds ("" when it can): below `lowest`, or never
        published (`trained`: the hub's version). A peer's number is checked before it is kept (status computes lags
        from it)."""
        published = self.weights.published(trained)
        if lowest <= version <= published:
            return ""
        return f"{version} of this run was never published (the newest is {published})"

    def heartbeat(self, msg: P.Heartbeat, gen: GeneratorInfo, version: int) -> P.Message:
        if why := self._unpublished(msg.version, -1, version):  # -1: it holds no weights of this run yet
            return self.refuse(f"Heartbeat from {gen.generator_id}: version {why}")
        if why := check_stages(msg.stage_s):
            return self.refuse(f"Heartbeat from {gen.generator_id}: {why}")
        gen.version, gen.tokens_per_s, gen.stage_s = msg.version, msg.tokens_per_s, msg.stage_s
        if msg.generated != gen.generated:  # its engine generated tokens (or finished a group) since the last one
            gen.generated = msg.generated
            self.registry.progressed(gen)
        if msg.draining and not gen.draining:  # no more broadcasts to it: its engine may already be stopping
            self.registry.drains(gen)
            self.weights.leave(msg.generator_id)
            self.journal.event("drain", gen.principal, generator=msg.generator_id)
        return P.HeartbeatReply(version, self.desk.reconcile(msg, gen), self.cfg.trainer.max_staleness)

    def weights_applied(self, msg: P.WeightsApplied, gen: GeneratorInfo, version: int) -> P.Message:
        if why := self._unpublished(msg.version, 0, version):
            return self.refuse(f"WeightsApplied from {gen.generator_id}: version {why}")
        gen.version = msg.version
        self.weights.applied(msg.generator_id, msg.version)
        if msg.version != gen.applied:  # a repeat is acknowledged, not journaled again
            gen.applied = msg.version
            self.registry.progressed(gen)
            self.journal.event("weights_applied", gen.principal, generator=msg.generator_id, version=msg.version,
                               load_ms=msg.load_ms, via=msg.via)
        return P.Ack()

    def leave(self, msg: P.Leave, gen: GeneratorInfo) -> P.Message:
        if msg.reason:
            log.error("hub: generator %s leaves: %s", msg.generator_id, msg.reason)
        if gen.received < msg.pushed:  # its last rollouts (a drain's) are still on their way on the rollouts socket
            gen.leaving = (msg.pushed, time.monotonic() + LEAVE_GRACE_S, msg.reason)
            return P.Ack()
        self.drop(msg.generator_id, "left", msg.reason)
        return P.Ack()

    def left_when_in(self, gen: GeneratorInfo) -> None:
        """A generator that said Leave before its last rollouts arrived goes once they are in (or LEAVE_GRACE_S on)."""
        if gen.leaving and self.registry.generators.get(gen.generator_id) is gen and (
                gen.received >= gen.leaving[0] or time.monotonic() > gen.leaving[1]):
            self.drop(gen.generator_id, "left", gen.leaving[2])

    def drop(self, gen_id: str, why: str, detail: str = "") -> None:
        """Forget a generator (it left, went silent, or re-registers): its leased prompts go back to the
        front of the queue, its process group (nccl) is closed, waiters are woken."""
        gen = self.registry.remove(gen_id)
        if gen is not None:
            self.server.forget(gen.ident)
        self.weights.leave(gen_id)
        n = self.ledger.take_back_all(gen_id) + self.evaluation.take_back(gen_id)
        self.journal.event("requeue" if why != "left" else "leave", gen.principal if gen else gen_id, generator=gen_id,
                           reason=detail or why, prompts=n)
        self.lock.notify_all()

    def refuse(self, what: str) -> P.Error:
        """A control message refused: counted, a strike against its source, logged (rate limited)."""
        self.counters["refused"] += 1
        self.server.strike()
        self.journal.warn("refused", "hub: refused %s", what)
        return P.Error(what)

