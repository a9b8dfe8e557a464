"""The hub: the learner's front door for generators, on rank 0. What each message does; its parts:

    hub/server.py          sockets, the hub thread, decoding, dispatch, muting of sources that send garbage
    hub/registry.py        generators, bound to their connection, key and session
    hub/ledger.py          where every prompt is (pending, leased, buffered, in the step, trained)
    pipeline/staleness.py  admission, lease minimum versions, the stale filter (the trainer's rules too)
    hub/leases.py          lease requests, heartbeats' lease lists, expiry
    hub/evaluation.py      held-out prompts sampled every eval.every versions, scored, not trained
    hub/prompts.py         a prompt's text, columns and token ids, as leased
    hub/validation.py      what a rollout says, checked against its lease and the run
    hub/faults.py          failed groups and rejected prompts: what they cost the run, once confirmed
    hub/operators.py       status and run-time changes
    hub/journal.py         events.jsonl, rate-limited logs
    pipeline/runspec.py    the run's spec, which every generator adopts before it registers (SpecRequest)
    hub/serving.py         the weight transports' side of registration, announcements and zmq pulls
    hub/trainer.py         what the learner may call (TrainerHub) and read for a step's record (HubStats)

The learner's thread calls the hub as a TrainerHub (`take_batch`, `finish_step`, ...) and its weight senders call
`announce`, each under a lock and a condition, so the hub keeps answering heartbeats and leases while a step trains.
The senders are the learner's, handed to the hub before it starts (`serve_weights`).
Every peer is hostile until shown otherwise: a message about a generator from another connection is refused,
a rejected rollout is counted by reason and its prompt leased again, a weights version it reports must be one
the hub published, and faults that could end the run (prompts no engine takes, reward functions that raise)
count only when confirmed by two principals or every registered one. What one principal may take is bounded:
its registrations (per key), its part of the lease window, how long it holds leases without progress, and what
it writes to events.jsonl a minute. A failure of the hub thread, or of the run (`failure`), ends `take_batch`
with that error.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hub.evaluation import Evaluation
from hub.faults import Faults
from hub.journal import Journal
from hub.leases import LeaseDesk
from hub.ledger import Key, PromptLedger
from hub.operators import Operators
from hub.prompts import Prompts
from hub.registry import GENERATOR_ID, GeneratorInfo, Registry
from hub.server import Server
from hub.serving import WeightServing
from hub.trainer import HubStats
from hub.validation import Expected, Rejected, RunShape, check_rollout, check_stages
from pipeline import pinning, runspec
from pipeline import protocol as P
from pipeline.config import Config, runtime_values
from pipeline.security import ServerAuth, has_role
from weights.base import Sender

if TYPE_CHECKING:
    import mmap

log = logging.getLogger(__name__)


LEAVE_GRACE_S = 10.0  # how long a leaving generator's last rollouts are waited for


class HubStopped(RuntimeError):
    """The hub was stopped while the learner waited on it, or the run cannot go on (the message says why)."""


class DatasetExhausted(HubStopped):
    """Every prompt of the last epoch (trainer.epochs) is trained or gone: the run ends early."""


class Hub:
    def __init__(self, cfg: Config, rows: list[dict], run_dir: Path, run_id: str, version: int = 0,
                 state: dict | None = None, *, encode: Callable[[str | list], list[int]], vocab_size: int,
                 eval_rows: list[dict] | None = None, fingerprints: dict[str, str] | None = None,
                 contents: dict[str, str] | None = None) -> None:
        """`fingerprints`: of the learner's model files (pipeline/fingerprint.py); `contents`: the digests of the code
        and files its config names (pipeline/pinning.py). Every generator's must be these."""
        self.cfg, self.run_dir, self.run_id = cfg, run_dir, run_id
        self.fingerprints = dict(fingerprints or {})
        self.contents = dict(contents or {})
        self.spec_digest = runspec.digest(cfg)  # what every generator serves: the run-time knobs aside, fixed
        self.prompts = Prompts(rows, cfg.data.prompt_column, encode, vocab_size, cfg.generator.max_model_len)
        self.version = version  # trained
        self.complete = False  # the learner is done: generators hear RunComplete
        self.lock = threading.Condition()
        self.counters = dict(bad_messages=0, refused=0, muted=0, unknown_lease=0, duplicates=0, stale_dropped=0,
                             requeued=0, rollouts=0, tokens=0, rejected_rollouts=0, rejected_prompts=0, lost_leases=0,
                             reward_errors=0, skipped_steps=0, refused_spec=0)
        self.registry = Registry(cfg.hub.max_generators, cfg.hub.max_generators_per_key)
        self.ledger = PromptLedger(len(rows), cfg.trainer.epochs, cfg.data.seed, self.counters)
        self.failure = ""  # why the run cannot go on: the learner's take_batch raises it
        self.verdict = ""  # what holds the run back, the learner's latest word (`set_verdict`)
        t = cfg.trainer
        self.shape = RunShape(vocab_size, t.group_size, cfg.sampling.max_tokens, cfg.generator.max_model_len,
                              len(cfg.rewards))
        # a rollout holds group_size x max_tokens x 8 bytes of arrays, plus rewards, strings and the prompt
        # (an agent's trajectory may be split into P.MAX_PARTS samples, each with its context: generator/agent.py)
        parts = P.MAX_PARTS if cfg.generator.rollout == "agent" else 1
        sample = 8 * cfg.sampling.max_tokens + 64 * len(cfg.rewards) + 512
        sample += 4 * cfg.generator.max_model_len if parts > 1 else 0
        limits = P.Limits(bytes=min(cfg.hub.max_message_mb * 2**20, 2 * t.group_size * parts * sample
                                    + 4 * cfg.generator.max_model_len + 2**16),
                          containers=2 * t.group_size * parts + 16)  # the group, its samples list, each sample, rewards
        if state:
            self.ledger.restore(state)
            self.counters.update(state.get("counters", {}))
        eval_prompts = Prompts(eval_rows or [], (cfg.eval.data or cfg.data).prompt_column, encode, vocab_size,
                               cfg.generator.max_model_len)
        self.evaluation = Evaluation(cfg, eval_prompts, self.shape, run_dir)  # eval.every: held-out prompts
        self.evaluation.start(version)
        self.auth = ServerAuth.load(cfg.auth.keys)
        self.server = Server(cfg.hub.host, cfg.hub.port, self.auth, limits, self, self.counters)
        self.weights = WeightServing(cfg, self.registry, self.server, version)  # its senders: `serve_weights`
        self.journal = Journal(run_dir, cfg.hub.journal_kib_per_minute, self.counters)
        self.faults = Faults(cfg, self.ledger, self.registry, self.journal, self.counters, self.failed)
        self.desk = LeaseDesk(cfg, self.ledger, self.registry, self.evaluation, self.prompts, self.faults, self.journal,
                              self.counters, self.lock, self.sampling)
        self.operators = Operators(cfg, self.ledger, self.registry, self.journal, self.counters, run_dir, run_id,
                                   self.auth is not None)
        if cfg.hub.host not in ("127.0.0.1", "localhost", "::1") and self.auth is None:
            log.warning("hub binds %s without auth.keys (hub.allow_insecure): anyone who reaches it can register, "
                        "send rollouts and change the run", cfg.hub.host)

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def rollouts_address(self) -> str:
        return self.server.endpoint(self.server.rollouts_port)

    def serve_weights(self, senders: dict[str, Sender]) -> None:
        """The learner's weight senders by transport (weights.senders, built with this hub as their Announcer), which
        its publisher drives: registration picks among them. Before `start`."""
        self.weights.senders = senders

    def start(self) -> None:
        if not self.weights.senders:  # else the first generator to register would be refused, not the run
            raise RuntimeError("Hub.start: no weight senders; hand the hub weights.senders(cfg, hub, run_id) with "
                               "serve_weights first")
        # what is loaded by now (the dataset's rows, the model's modules) lives as long as the run: frozen, Python's
        # full collections no longer walk it. They hold every thread, the hub's answers too: 257 ms at worst with
        # 1,024 generators before (docs/figures.md, "The hub's ceiling")
        gc.collect()
        gc.freeze()
        self.server.start()
        log.info("hub listening on %s%s", self.address, " (CURVE: listed keys only)" if self.auth else "")

    def stop(self) -> None:
        self.server.stop()
        self.weights.shutdown()
        with self.lock:
            self.lock.notify_all()

    # ---- what the server hands over -----------------------------------------------------------------

    def control(self, msg: P.Message, ident: bytes, user: str) -> P.Message:
        handler = getattr(self, f"_on_{msg.tag}", None)
        if handler is None:
            self.malformed(f"control: unexpected {type(msg).__name__}", False)
            return P.Error(f"unexpected message {type(msg).__name__} on the control channel")
        with self.lock:
            if isinstance(msg, (P.StatusRequest, P.SetRequest)):
                if self.auth is not None and not has_role(user, "operator"):
                    return self._refuse(f"{type(msg).__name__}: needs an operator key (auth.keys/operators)")
                return handler(msg)
            if self.auth is not None and not has_role(user, "generator"):
                return self._refuse(f"{type(msg).__name__}: needs a generator key (auth.keys/generators)")
            if self.failure:
                return P.Error(f"the run failed: {self.failure}", stop=True)
            if isinstance(msg, P.Register):
                return self._on_register(msg, ident, user)
            if isinstance(msg, P.SpecRequest):
                return self._on_spec_request(msg, user)
            # what is left is a generator's message, each with a generator_id (mypy sees only a Message)
            gen, error = self.registry.speaker(msg.generator_id, ident, user)  # type: ignore[attr-defined]
            if gen is None:
                assert error is not None  # speaker says why it has no generator
                return error if error.fatal else self._refuse(f"{type(msg).__name__} for {error.message}")
            return handler(msg, gen)

    def malformed(self, what: str, rollout: bool) -> None:
        if rollout:
            self._reject("malformed", what, "?")
            return
        self.counters["bad_messages"] += 1
        self.server.strike()
        self.journal.warn("bad", "hub: rejected %s", what)

    def failed(self, why: str) -> None:
        with self.lock:
            if not self.failure:
                self.failure = why
                log.error("hub: the run cannot go on: %s", why)
            self.lock.notify_all()

    def tick(self) -> None:
        """Generators that went silent are dropped; leases not returned in time go back to the queue."""
        now = time.monotonic()
        with self.lock:
            for gen in self.registry.silent(self.cfg.hub.heartbeat_timeout_s):
                log.warning("hub: generator %s silent for %.1f s: dropped, its leases re-queued", gen.generator_id,
                            now - gen.last_seen)
                self._drop_generator(gen.generator_id, "heartbeat timeout")
            for gen in [g for g in self.registry.generators.values() if g.leaving]:
                self._left_when_in(gen)
            self.desk.expire_old(now)

    # ---- generators ---------------------------------------------------------------------------------

    def _on_register(self, msg: P.Register, ident: bytes, user: str) -> P.Message:
        refusal, forged = self.registry.refusal(msg, user)
        if refusal:
            return self._refuse(refusal) if forged else P.Error(refusal, stop=True)
        if why := self._serves_another(msg.spec_digest, msg.fingerprints, msg.contents):
            return self._refuse_spec(msg.generator_id, user, why)
        if msg.loaded_run == self.run_id and (why := self._unpublished(msg.loaded_version, -1)):
            return P.Error(f"registration refused: loaded_version {why}", stop=True)
        old = self.registry.generators.get(msg.generator_id)
        if old is not None:  # a reconnect under the same id, with its session
            self.weights.leave(old.generator_id, again=True)
            self._drop_generator(msg.generator_id, "re-registered")
        try:
            transport, collective = self.weights.join(msg, ident, self.version)
        except ValueError as e:
            return P.Error(str(e), fatal=True)
        loaded = msg.loaded_version if msg.loaded_run == self.run_id else -1  # weights of another run: reloaded
        gen = self.registry.add(msg, ident, user, transport, loaded)
        last = self.weights.last_ready
        self.journal.event("register", gen.principal, generator=gen.generator_id, host=gen.host, gpus=gen.gpus,
                           transport=transport, key=user.split(":", 1)[-1], version=self.version,
                           weights=self.version if collective is not None or last is None else last.version)
        return P.Welcome(
            run_id=self.run_id, generator_id=gen.generator_id, version=self.version,
            rollouts_endpoint=self.rollouts_address, transport=transport, heartbeat_s=self.cfg.hub.heartbeat_s,
            sampling=self.sampling(), group_size=self.cfg.trainer.group_size, index=gen.index,
            collective=collective, session=gen.session)

    def _on_spec_request(self, msg: P.SpecRequest, user: str) -> P.Message:
        """The run's spec, unless the generator's claims, fingerprints or a problem it reports say it cannot serve
        the run (refused and counted, naming the field)."""
        if not GENERATOR_ID.fullmatch(msg.generator_id):
            return self._refuse(f"SpecRequest: generator_id {msg.generator_id[:40]!r}")
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

    def sampling(self) -> P.Sampling:
        s = self.cfg.sampling
        return P.Sampling(s.max_tokens, s.temperature, s.top_p, s.ignore_eos)

    @property
    def published(self) -> int:
        """The newest version announced: no engine can hold a newer one."""
        return max(self.version, self.weights.newest)

    def _unpublished(self, version: int, lowest: int) -> str:
        """Why a version a generator reports cannot be one it holds ("" when it can): below `lowest`, or never
        published. A peer's number is checked before it is kept (status computes lags from it)."""
        if lowest <= version <= self.published:
            return ""
        return f"{version} of this run was never published (the newest is {self.published})"

    def _on_heartbeat(self, msg: P.Heartbeat, gen: GeneratorInfo) -> P.Message:
        if why := self._unpublished(msg.version, -1):  # -1: it holds no weights of this run yet
            return self._refuse(f"Heartbeat from {gen.generator_id}: version {why}")
        if why := check_stages(msg.stage_s):
            return self._refuse(f"Heartbeat from {gen.generator_id}: {why}")
        gen.version, gen.tokens_per_s, gen.stage_s = msg.version, msg.tokens_per_s, msg.stage_s
        if msg.generated != gen.generated:  # its engine generated tokens (or finished a group) since the last one
            gen.generated = msg.generated
            self.registry.progressed(gen)
        if msg.draining and not gen.draining:  # no more broadcasts to it: its engine may already be stopping
            self.registry.drains(gen)
            self.weights.leave(msg.generator_id)
            self.journal.event("drain", gen.principal, generator=msg.generator_id)
        return P.HeartbeatReply(self.version, self.desk.reconcile(msg, gen), self.cfg.trainer.max_staleness)

    def _on_weights_applied(self, msg: P.WeightsApplied, gen: GeneratorInfo) -> P.Message:
        if why := self._unpublished(msg.version, 0):
            return self._refuse(f"WeightsApplied from {gen.generator_id}: version {why}")
        gen.version = msg.version
        self.weights.applied(msg.generator_id, msg.version)
        if msg.version != gen.applied:  # a repeat is acknowledged, not journaled again
            gen.applied = msg.version
            self.registry.progressed(gen)
            self.journal.event("weights_applied", gen.principal, generator=msg.generator_id, version=msg.version,
                               load_ms=msg.load_ms, via=msg.via)
        return P.Ack()

    def _on_weights_fetch(self, msg: P.WeightsFetch, gen: GeneratorInfo) -> P.Message:
        return self.weights.chunk(msg, gen, self.version)

    def _on_leave(self, msg: P.Leave, gen: GeneratorInfo) -> P.Message:
        if msg.reason:
            log.error("hub: generator %s leaves: %s", msg.generator_id, msg.reason)
        if gen.received < msg.pushed:  # its last rollouts (a drain's) are still on their way on the rollouts socket
            gen.leaving = (msg.pushed, time.monotonic() + LEAVE_GRACE_S, msg.reason)
            return P.Ack()
        self._drop_generator(msg.generator_id, "left", msg.reason)
        return P.Ack()

    def _left_when_in(self, gen: GeneratorInfo) -> None:
        """A generator that said Leave before its last rollouts arrived goes once they are in (or LEAVE_GRACE_S on)."""
        if gen.leaving and self.registry.generators.get(gen.generator_id) is gen and (
                gen.received >= gen.leaving[0] or time.monotonic() > gen.leaving[1]):
            self._drop_generator(gen.generator_id, "left", gen.leaving[2])

    def _drop_generator(self, gen_id: str, why: str, detail: str = "") -> None:
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

    # ---- leases (hub/leases.py) ------------------------------------------------------------------

    def _on_lease_request(self, msg: P.LeaseRequest, gen: GeneratorInfo) -> P.Message:
        return self.desk.request(msg, gen, self.version, self.complete)

    # ---- rollouts and failed groups -----------------------------------------------------------------

    def rollout(self, msg: P.RolloutGroup, user: str) -> None:
        key = (msg.epoch, msg.prompt_id)
        with self.lock:
            gen, reason, detail = self.registry.sender(msg, user)
            if gen is None:
                self._reject(reason, detail, msg.generator_id)
                return
            gen.received += 1
            try:
                self._received(msg, gen, key)
            finally:
                self._left_when_in(gen)

    def _received(self, msg: P.RolloutGroup, gen: GeneratorInfo, key: Key) -> None:
        """A rollout of a registered generator, under the lock: scored (evaluation), buffered, or refused."""
        self.registry.progressed(gen)  # a group came back (valid or not): its engine runs
        if self.evaluation.owns(msg.lease_id):  # scored, not trained (hub/evaluation.py)
            try:
                self.evaluation.received(msg, gen.generator_id, self.published)
            except Rejected as e:
                self._reject(e.reason, e.detail, gen.generator_id)
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
            self._reject("lease", f"rollout for prompt {key} of lease {msg.lease_id}, which is leased to "
                                  "another generator", gen.generator_id)
            self._count_against(gen, f"lease: a rollout for lease {msg.lease_id} of another generator")
            return
        expected = Expected(lease.items[key].prompt_ids, lease.temperature, lease.min_version)
        self.ledger.settle(msg.lease_id, key)
        try:
            check_rollout(msg, expected, self.published, self.shape)
        except Rejected as e:
            self.ledger.requeue([key])  # its prompt is leased again
            self._reject(e.reason, e.detail, gen.generator_id)
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
            self._drop_generator(gen.generator_id, "quarantined", why)

    def _on_group_failed(self, msg: P.GroupFailed, gen: GeneratorInfo) -> P.Message:
        """A generator could not generate a leased prompt: hub/faults.py decides what it costs."""
        key = (msg.epoch, msg.prompt_id)
        if self.evaluation.owns(msg.lease_id):
            return P.Ack(known=self.evaluation.failed(msg.lease_id, msg.prompt_id, msg.generator_id))
        lease = self.ledger.leases.get(msg.lease_id)
        if lease is None or lease.generator_id != msg.generator_id or key not in lease.items:
            return P.Ack(known=False)
        if msg.kind not in ("engine", "prompt", "reward", "agent"):
            return P.Error(f"GroupFailed.kind: {msg.kind!r} is not engine, prompt, reward or agent")
        self.ledger.settle(msg.lease_id, key)
        self.registry.progressed(gen)
        self.faults.group_failed(msg, gen.principal)
        self.lock.notify_all()
        return P.Ack()

    def _reject(self, reason: str, detail: str, gen_id: str) -> None:
        """A rollout that is not trained: counted by reason, logged (rate limited), named in the detail."""
        self.counters["rejected_rollouts"] += 1
        self.counters[f"rejected/{reason}"] = self.counters.get(f"rejected/{reason}", 0) + 1
        self.server.strike()
        self.journal.warn(f"rejected/{reason}", "hub: rejected a rollout from %s (%s): %s", gen_id, reason, detail)

    def _refuse(self, what: str) -> P.Error:
        self.counters["refused"] += 1
        self.server.strike()
        self.journal.warn("refused", "hub: refused %s", what)
        return P.Error(what)

    # ---- operators (hub/operators.py) ----------------------------------------------------------------

    def _on_status_request(self, msg: P.StatusRequest) -> P.Message:
        return self.status()

    def _on_set_request(self, msg: P.SetRequest) -> P.Message:
        return self.operators.set_knob(msg, self.version, self.next_step())

    def status(self) -> P.StatusReply:
        return self.operators.status(self.version, self.failure, self.verdict)

    def set_verdict(self, line: str) -> None:
        """The learner's latest word on what holds the run back (pipeline/verdict.py), for `pipeline status`."""
        with self.lock:
            self.verdict = line

    # ---- the learner's thread -----------------------------------------------------------------------

    def take_batch(self, step: int, wait_s: float | None = None) -> tuple[list[P.RolloutGroup] | None, dict, dict]:
        """Block until batch_size groups fresh enough for `step` are buffered; stale ones are dropped and their
        prompts leased again. Returns (the batch, its stats, the run-time knobs it was built under): the step
        trains with those knobs on every rank and records that bound, whatever `pipeline set` changes meanwhile
        (a change holds from the next batch taken: `next_step`). The batch is None when `wait_s` passed first."""
        B = self.cfg.trainer.batch_size
        stats = {"staleness/dropped": 0}
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self.lock:
            while True:
                if self.server.stopped:
                    raise HubStopped("hub stopped while the learner waited for rollouts")
                if self.failure:
                    raise HubStopped(self.failure)
                knobs = runtime_values(self.cfg)
                k = knobs["trainer.max_staleness"]
                batch, dropped = self.ledger.batch(step, k, B)
                if dropped:
                    stats["staleness/dropped"] += dropped
                    log.info("step %d: dropped %d groups older than max_staleness=%d, prompts re-queued", step,
                             dropped, k)
                if batch is not None:
                    return batch, stats, knobs
                if self.ledger.exhausted():
                    raise DatasetExhausted(
                        f"dataset exhausted: trainer.epochs={self.cfg.trainer.epochs} over {len(self.prompts)} prompts "
                        f"gave {self.ledger.trained} trained groups, {len(self.ledger.buffer)} left, fewer than "
                        f"a batch of {B}; the run ends at version {self.version} of trainer.total_steps="
                        f"{self.cfg.trainer.total_steps}")
                if deadline is not None and time.monotonic() > deadline:
                    return None, stats, knobs
                self.lock.wait(0.5)

    def next_step(self) -> int:
        """The first step whose batch is not taken yet: a run-time change made now holds from it."""
        return self.version + (1 if self.ledger.in_step else 0)

    def finish_step(self, version: int) -> None:
        """The step that produced `version` is done: its groups join the ledger, admission moves on."""
        with self.lock:
            self.ledger.finish_step()
            self.version = version
            self.evaluation.start(version)
            self.weights.newest = max(self.weights.newest, version)
            self.lock.notify_all()

    def abandon_step(self) -> None:
        """The step was skipped (not finite): its groups are not trained, their prompts are leased again."""
        with self.lock:
            self.ledger.abandon_step()
            self.lock.notify_all()

    def finish_run(self) -> None:
        """Training is over (all steps, or the dataset ran out): generators hear RunComplete and leave."""
        with self.lock:
            self.complete = True

    def evaluations(self, wait_s: float = 0.0) -> list[dict]:
        """Evaluation rounds done since the last call; `wait_s`: first wait that long for running ones (while a
        generator is there to run them)."""
        with self.lock:
            self.lock.wait_for(lambda: not self.evaluation.busy() or self.server.stopped
                               or not self.registry.generators, wait_s)
            return self.evaluation.done()

    def step_stats(self) -> HubStats:
        """What a step's record reads of the hub, copied at once: the hub's thread changes it meanwhile."""
        with self.lock:
            gens = self.registry.generators
            return HubStats(tokens=self.counters["tokens"], generators=len(gens), counters=dict(self.counters),
                            busy=dict(self.server.busy),  # (added to outside the lock: dict() copies it whole)
                            stages={g.generator_id: dict(g.stage_s) for g in gens.values()})

    def wait_generators_gone(self, timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: not self.registry.generators, timeout)

    def announce(self, ready: P.WeightsReady, blob: bytes | bytearray | mmap.mmap | None, to: list[str] | None = None,
                 delta: bytes | None = None, transports: set[str] | None = None) -> None:
        """Serve `blob` for zmq generators and push the announcement (any thread). A file announcement goes to
        every generator of `transports` (a later one gets it after its Welcome); a collective one to the
        generators in `to`, the ones the broadcasts will reach."""
        with self.lock:
            self.weights.announce(ready, blob, to, delta, transports)
        self.server.wake()

    def push(self, ident: bytes, ready: P.WeightsReady) -> None:
        self.server.push(ident, P.encode(ready))

    def last_file_version(self) -> P.WeightsReady | None:
        return self.weights.last_ready

    def drop(self, generator_id: str, reason: str) -> None:
        """Forget a generator (any thread; e.g. a weight sender gave up on it): its prompts are leased again, and its
        next request is told to register again."""
        with self.lock:
            self._drop_generator(generator_id, "dropped", reason)

    def wants_blobs(self, transports: set[str]) -> bool:
        """Some generator uses one of the transports (a file of each version is needed), or none is registered."""
        with self.lock:
            return self.registry.wants(transports)

    def uses_transport(self, name: str) -> bool:
        with self.lock:
            return self.registry.uses(name)

    def snapshot(self) -> dict:
        """Hub state for a checkpoint taken between steps: leased and buffered prompts count as pending."""
        with self.lock:
            return {"version": self.version, **self.ledger.snapshot(), "counters": dict(self.counters)}
