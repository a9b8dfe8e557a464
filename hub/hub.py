"""The hub: the learner's front door for generators, on rank 0. Which part each message goes to; the parts:

    hub/server.py          sockets, the hub thread, decoding, dispatch, muting of sources that send garbage
    hub/membership.py      the run's spec, registration, heartbeats, weights applied, leaving, dropping a generator
    hub/intake.py          rollouts and failed groups: checked, then buffered, scored or rejected
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
from hub.intake import Intake
from hub.journal import Journal
from hub.leases import LeaseDesk
from hub.ledger import PromptLedger
from hub.membership import Membership
from hub.operators import Operators
from hub.prompts import Prompts
from hub.registry import GeneratorInfo, Registry
from hub.server import Server
from hub.serving import WeightServing
from hub.trainer import HubStats
from hub.validation import RunShape
from pipeline import protocol as P
from pipeline.config import Config
from pipeline.runtime_knobs import runtime_values
from pipeline.security import ServerAuth, has_role
from weights.base import Sender

if TYPE_CHECKING:
    import mmap

log = logging.getLogger(__name__)

# a batch waits for a group whose last chance it is only while its generator was heard within this many heartbeat
# periods: a process killed or frozen holds its leases until hub.heartbeat_timeout_s, and the run would wait for them
LAST_CHANCE_HEARTBEATS = 3


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
        self.prompts = Prompts(rows, cfg.data.prompt_column, encode, vocab_size, cfg.generator.max_model_len)
        self.version = version  # trained
        self.complete = False  # the learner is done: generators hear RunComplete
        self.lock = threading.Condition()
        self.counters = dict(bad_messages=0, refused=0, muted=0, unknown_lease=0, duplicates=0, stale_dropped=0,
                             stale_stopped=0, requeued=0, rollouts=0, tokens=0, rejected_rollouts=0,
                             rejected_prompts=0, lost_leases=0, reward_errors=0, skipped_steps=0, refused_spec=0)
        self.registry = Registry(cfg.hub.max_generators, cfg.hub.max_generators_per_key)
        self.ledger = PromptLedger(len(rows), cfg.trainer.epochs, cfg.data.seed, self.counters)
        self.failure = ""  # why the run cannot go on: the learner's take_batch raises it
        self.stopped_seen = 0  # counters["stale_stopped"] when the learner last took a batch
        self.last_chance_held: tuple[int, float] | None = None  # (step, since when its batch waits for last-chance
        # groups): kept across take_batch calls
        self.verdict = ""  # what holds the run back, the learner's latest word (`set_verdict`)
        t = cfg.trainer
        self.shape = RunShape(vocab_size, t.group_size, cfg.sampling.max_tokens, cfg.generator.max_model_len,
                              len(cfg.rewards))
        # a rollout holds group_size x max_tokens x 8 bytes of arrays, plus rewards, strings and the prompt
        # (an agent's trajectory may be split into P.MAX_PARTS samples, each with its context: generator/agent.py)
        parts = P.MAX_PARTS if cfg.generator.rollout == "builtin:agent" else 1
        sample = 8 * cfg.sampling.max_tokens + 64 * len(cfg.rewards) + 512
        sample += 4 * cfg.generator.max_model_len if parts > 1 else 0
        limits = P.Limits(bytes=min(cfg.hub.max_message_mb * 2**20, 2 * t.group_size * parts * sample
                                    + 4 * cfg.generator.max_model_len + 2**16),
                          containers=2 * t.group_size * parts + 16)  # the group, its samples list, each sample, rewards
        if state:
            self.ledger.restore(state)
            self.counters.update(state.get("counters", {}))
            self.stopped_seen = self.counters["stale_stopped"]  # a resumed run's steps count their own
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
        self.membership = Membership(cfg, run_id, dict(fingerprints or {}), dict(contents or {}), self.rollouts_address,
                                     self.registry, self.weights, self.ledger, self.evaluation, self.desk, self.server,
                                     self.journal, self.counters, self.lock, self.sampling)
        self.intake = Intake(cfg, self.shape, self.registry, self.ledger, self.evaluation, self.faults, self.membership,
                             self.server, self.journal, self.counters, self.lock)
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
                    return self.membership.refuse(f"{type(msg).__name__}: needs an operator key (auth.keys/operators)")
                return handler(msg)
            if self.auth is not None and not has_role(user, "generator"):
                return self.membership.refuse(f"{type(msg).__name__}: needs a generator key (auth.keys/generators)")
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
                return error if error.fatal else self.membership.refuse(f"{type(msg).__name__} for {error.message}")
            return handler(msg, gen)

    def malformed(self, what: str, rollout: bool) -> None:
        if rollout:
            self.intake.reject("malformed", what, "?")
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
                self.membership.drop(gen.generator_id, "heartbeat timeout")
            for gen in [g for g in self.registry.generators.values() if g.leaving]:
                self.membership.left_when_in(gen)
            self.desk.expire_old(now)

    def rollout(self, msg: P.RolloutGroup, user: str) -> None:
        with self.lock:
            self.intake.rollout(msg, user, self.weights.published(self.version))

    # ---- generators (hub/membership.py) and their failed groups (hub/intake.py) ----------------------------

    def sampling(self) -> P.Sampling:
        s = self.cfg.sampling
        return P.Sampling(s.max_tokens, s.temperature, s.top_p, s.ignore_eos)

    def _on_register(self, msg: P.Register, ident: bytes, user: str) -> P.Message:
        return self.membership.register(msg, ident, user, self.version)

    def _on_spec_request(self, msg: P.SpecRequest, user: str) -> P.Message:
        return self.membership.spec_request(msg, user)

    def _on_heartbeat(self, msg: P.Heartbeat, gen: GeneratorInfo) -> P.Message:
        return self.membership.heartbeat(msg, gen, self.version)

    def _on_weights_applied(self, msg: P.WeightsApplied, gen: GeneratorInfo) -> P.Message:
        return self.membership.weights_applied(msg, gen, self.version)

    def _on_weights_fetch(self, msg: P.WeightsFetch, gen: GeneratorInfo) -> P.Message:
        return self.weights.chunk(msg, gen, self.version)

    def _on_leave(self, msg: P.Leave, gen: GeneratorInfo) -> P.Message:
        return self.membership.leave(msg, gen)

    def _on_group_failed(self, msg: P.GroupFailed, gen: GeneratorInfo) -> P.Message:
        return self.intake.group_failed(msg, gen, self.version)

    # ---- leases (hub/leases.py) ------------------------------------------------------------------

    def _on_lease_request(self, msg: P.LeaseRequest, gen: GeneratorInfo) -> P.Message:
        return self.desk.request(msg, gen, self.version, self.complete)

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
        stats = {"staleness/dropped": 0, "staleness/last_chance_wait_s": 0.0}
        silence = LAST_CHANCE_HEARTBEATS * self.cfg.hub.heartbeat_s  # a generator killed or frozen is not waited for

        def heard(generator_id: str) -> bool:
            return self.registry.heard(generator_id, silence)

        start = time.monotonic()
        deadline = None if wait_s is None else start + wait_s
        with self.lock:
            # since when the batch for `step` waits for groups still out whose last chance it is: kept across calls
            # (a learner of several ranks asks every KEEPALIVE_S), so trainer.last_chance_wait_s bounds the whole wait
            held = self.last_chance_held[1] if self.last_chance_held and self.last_chance_held[0] == step else None

            def waited() -> float:  # this call's share of the wait for last-chance groups (next_batch adds them up)
                return 0.0 if held is None else time.monotonic() - max(held, start)

            while True:
                if self.server.stopped:
                    raise HubStopped("hub stopped while the learner waited for rollouts")
                if self.failure:
                    raise HubStopped(self.failure)
                knobs = runtime_values(self.cfg)
                k = knobs["trainer.max_staleness"]
                now = time.monotonic()
                patience = self.cfg.trainer.last_chance_wait_s - (now - held if held is not None else 0.0)
                batch, dropped, out = self.ledger.batch(step, k, B, for_last_chance=patience > 0, heard=heard)
                if dropped:
                    stats["staleness/dropped"] += dropped
                    log.info("step %d: dropped %d groups older than max_staleness=%d, prompts re-queued", step,
                             dropped, k)
                if out and held is None:
                    held = now
                    self.last_chance_held = (step, held)
                if batch is not None:  # and the groups generators stopped as stale since the last batch
                    stats["staleness/stopped"] = self.counters["stale_stopped"] - self.stopped_seen
                    self.stopped_seen = self.counters["stale_stopped"]
                    stats["staleness/last_chance_wait_s"] = waited()
                    self.last_chance_held = None
                    return batch, stats, knobs
                if self.ledger.exhausted():
                    raise DatasetExhausted(
                        f"dataset exhausted: trainer.epochs={self.cfg.trainer.epochs} over {len(self.prompts)} prompts "
                        f"gave {self.ledger.trained} trained groups, {len(self.ledger.buffer)} left, fewer than "
                        f"a batch of {B}; the run ends at version {self.version} of trainer.total_steps="
                        f"{self.cfg.trainer.total_steps}")
                if deadline is not None and time.monotonic() > deadline:
                    stats["staleness/last_chance_wait_s"] = waited()
                    return None, stats, knobs
                left = 0.5 if deadline is None else max(0.0, deadline - time.monotonic())
                self.lock.wait(min(0.5, left, patience) if out else 0.5)

    def ahead(self, step: int) -> list[P.RolloutGroup]:
        """The buffered groups the batch for `step` would take first, as they stand now (`PromptLedger.ahead`)."""
        with self.lock:
            return self.ledger.ahead(step, self.cfg.trainer.max_staleness, self.cfg.trainer.batch_size)

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
                            stages={g.generator_id: dict(g.stage_s) for g in gens.values()},
                            on_learner_gpus=sum(g.on_learner_gpus for g in gens.values()))

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
            self.membership.drop(generator_id, "dropped", reason)

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
