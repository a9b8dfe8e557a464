"""The hub: the learner's front door for generators. Runs in its own thread on rank 0.

Sockets (the hub binds, generators connect; CURVE servers when `auth.keys` is set, pipeline/security.py):
  control  ROUTER  Register/Heartbeat/LeaseRequest/WeightsApplied/WeightsFetch/GroupFailed/Leave/Status/Set
  rollouts PULL    RolloutGroup, one per prompt
  weights  PUB     WeightsReady announcements
Only the hub thread touches these sockets; the learner thread talks to the hub through `take_batch`
and `finish_step` (a lock, a condition and an inproc wake-up socket), so the hub keeps answering
heartbeats and leases while a training step runs. A failure of the hub thread itself stops the learner.

Every peer is hostile until shown otherwise. A generator id is bound at registration to the connection
that registered it (its ROUTER identity; with keys, its public key) and to a secret session its rollouts
carry; a message about a generator from anywhere else is refused and counted. Re-registering under a live
id needs that session. Every rollout is checked against the run (learner/validation.py) and against its
lease (held by the sender) before it enters the buffer; a rejected one is counted by reason and its prompt
leased again. Faults that could end the run (prompts no engine takes, reward functions that raise) count
only when confirmed: reported by two principals (keys; ids without keys), or by every registered one.

Every prompt of an epoch lives in exactly one place: pending (a deque), a lease, the buffer of
received groups, the step being trained, or the trained ledger. Admission keeps the groups in flight
(leased + buffered + in the current step) at most (max_staleness + 1) x batch_size. Leases that are not
returned within `hub.lease_timeout_s`, or that their generator stops reporting, go back to pending.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import random
import re
import secrets
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from learner.validation import Expected, Rejected, RunShape, check_prompt_ids, check_rollout
from pipeline import protocol as P
from pipeline.config import Config, ConfigError, apply_runtime_change
from pipeline.security import ServerAuth, has_role, user_of
from pipeline.transports import host_identity

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (epoch, prompt_id)
GENERATOR_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_ATTEMPTS = 3  # a prompt whose group failed this often in engines is rejected like an invalid one
CHUNKS_IN_FLIGHT = 5  # weight chunks per peer not yet handed to the network (the generator keeps 4 in flight)
STRIKES_PER_S = 20  # bad messages from one source in a second, past which its messages are dropped undecoded


@dataclass
class GeneratorInfo:
    generator_id: str
    host: str
    gpus: str
    pid: int
    index: int
    transport: str
    last_seen: float
    ident: bytes = b""  # the connection that registered it (its ROUTER identity): where pushed messages go
    user: str = ""  # its CURVE user id ("ROLES:KEY"; "" without keys)
    session: str = ""  # secret of this registration: its rollouts carry it
    version: int = -1
    tokens_per_s: float = 0.0
    groups: int = 0
    tokens: int = 0  # rollout tokens received from it
    draining: bool = False  # told us it is finishing its groups before it leaves
    received: int = 0  # rollouts of this registration that reached the hub (trained or not)
    joined_at: float = field(default_factory=time.time)


@dataclass
class LeaseState:
    lease_id: int
    generator_id: str
    items: dict[Key, P.PromptItem]  # not yet received
    temperature: float
    min_version: int
    granted: float  # time.monotonic()
    unreported: int = 0  # consecutive heartbeats of its generator that did not list it


class HubStopped(RuntimeError):
    """The hub was stopped while the learner waited on it, or the run cannot go on (the message says why)."""


class DatasetExhausted(HubStopped):
    """Every prompt of the last epoch (trainer.epochs) is trained or gone: the run ends early."""


class Hub:
    def __init__(self, cfg: Config, rows: list[dict], run_dir: Path, run_id: str, version: int = 0,
                 state: dict | None = None, collective=None, *, encode: Callable[[str], list[int]],
                 vocab_size: int):
        self.cfg, self.rows, self.run_dir, self.run_id = cfg, rows, run_dir, run_id
        self.encode = encode  # prompt text -> token ids, as the generators must generate from them
        self.collective = collective  # learner.collective.CollectivePeers for the nccl transport
        self.on_file_join = None  # callable(): a file-transport generator needs a blob of the newest version
        self.version = self.newest = version  # trained; announced (a rollout may already come from it)
        self.complete = False  # the learner is done: generators hear "run complete"
        self.lock = threading.Condition()
        self.generators: dict[str, GeneratorInfo] = {}
        self.leases: dict[int, LeaseState] = {}
        self.pending: deque[Key] = deque()
        self.buffer: list[tuple[P.RolloutGroup, float]] = []
        self.in_step: list[P.RolloutGroup] = []
        self.trained: set[Key] = set()
        self.next_epoch = 0
        self.counters = dict(bad_messages=0, refused=0, muted=0, unknown_lease=0, duplicates=0, stale_dropped=0,
                             requeued=0, rollouts=0, tokens=0, rejected_rollouts=0, rejected_prompts=0, lost_leases=0,
                             reward_errors=0, skipped_steps=0)
        self.attempts: dict[Key, int] = {}  # engine failures per prompt (leased again up to MAX_ATTEMPTS)
        self.failed_by: dict[Key, set[str]] = {}  # principals (keys, or ids) that failed the prompt, any kind
        self.confirmed_reward_errors = 0  # reward errors every principal that could try agreed on
        self.failure = ""  # why the run cannot go on: the learner's take_batch raises it
        self.last_ready: P.WeightsReady | None = None
        self.blobs: dict[int, bytes] = {}  # zmq transport: the latest safetensors blobs by version
        t = cfg.trainer
        self.shape = RunShape(vocab_size, t.group_size, cfg.sampling.max_tokens, cfg.generator.max_model_len,
                              len(cfg.rewards))
        # a rollout holds group_size x max_tokens x 8 bytes of arrays, plus rewards, strings and the prompt
        self.rollout_limits = P.Limits(bytes=min(cfg.hub.max_message_mb * 2**20, 2 * t.group_size * (
            8 * cfg.sampling.max_tokens + 64 * len(cfg.rewards) + 512) + 4 * cfg.generator.max_model_len + 2**16),
            containers=2 * t.group_size + 16)  # the group, its samples list, each sample and its rewards
        self.auth = ServerAuth.load(cfg.auth.keys)
        # lease ids never repeat across learner restarts: a late rollout for an old lease is recognised
        self._lease_ids = itertools.count(random.SystemRandom().randrange(1, 2**40) * 1000)
        self._gen_index = itertools.count()
        self._outbox: deque[tuple[bytes | None, bytes]] = deque()  # (ROUTER identity or None for PUB, message)
        self._sending: dict[bytes, list] = {}  # ROUTER identity -> [(tracker, bytes)] of weight chunks
        self._logged: dict[str, list[float]] = {}  # rate limit of repeated warnings, by kind
        self._strikes: dict[bytes | str, list] = {}  # source (key, else connection) -> [second, bad messages]
        self._source: bytes | str | None = None  # of the message being handled
        self._stopped = threading.Event()
        self._wake_lock = threading.Lock()
        self._boot_id = host_identity()[1]
        if state:
            self._restore(state)
        self._bind()

    # ---- sockets and thread ---------------------------------------------------------------------

    def _bind(self) -> None:
        hub = self.cfg.hub
        self.ctx = zmq.Context()
        if self.auth is not None:  # before any socket binds: a CURVE server without a ZAP handler admits anyone
            self.auth.bind_zap(self.ctx)
        # a message past the decoder's limit gets an error reply; past twice that, zmq drops the connection
        self.control = self._socket(zmq.ROUTER, 2 * P.FROM_PEER.bytes)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.control.setsockopt(zmq.SNDHWM, 1000)  # replies are small (weight chunks are counted apart)
        self.control.setsockopt(zmq.RCVHWM, 256)
        host = hub.host
        if hub.port:
            self.control.bind(f"tcp://{host}:{hub.port}")
            self.port = hub.port
        else:
            self.port = self.control.bind_to_random_port(f"tcp://{host}")
        self.rollouts = self._socket(zmq.PULL, self.rollout_limits.bytes)
        self.rollouts.setsockopt(zmq.RCVHWM, 10_000)
        self.rollouts_port = self.rollouts.bind_to_random_port(f"tcp://{host}")
        self.pub = self._socket(zmq.PUB, 1024)
        self.pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://hub-wake-{id(self)}")
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://hub-wake-{id(self)}")
        if host not in ("127.0.0.1", "localhost", "::1") and self.auth is None:
            log.warning("hub binds %s without auth.keys (hub.allow_insecure): anyone who reaches it can register, "
                        "send rollouts and change the run", host)

    def _socket(self, kind: int, max_bytes: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # zmq drops the connection of a peer that sends more
        if self.auth is not None:
            self.auth.secure_server(sock)
        return sock

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.cfg.hub.host in ("0.0.0.0", "*") else self.cfg.hub.host
        return f"tcp://{host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="hub", daemon=True)
        self._thread.start()
        log.info("hub listening on %s%s", self.address, " (CURVE: listed keys only)" if self.auth else "")

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._wake_lock:
            self._wake_tx.send(b"")
        self._thread.join(timeout=5)
        with self.lock:
            self.lock.notify_all()
        for s in (self.control, self.rollouts, self.pub, self._wake_rx, self._wake_tx, self.auth and self.auth.zap):
            if s is not None:
                s.close(linger=0)
        self.ctx.term()

    def _serve(self) -> None:
        """The hub thread. A bug outside the handlers of single messages ends the run with its traceback: the
        learner, waiting in take_batch, raises it instead of waiting forever."""
        try:
            self._loop()
        except Exception:
            log.exception("hub: the hub thread failed")
            self._fail(f"the hub thread failed:\n{traceback.format_exc()}")

    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in (self.control, self.rollouts, self._wake_rx, self.auth and self.auth.zap):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        while not self._stopped.is_set():
            events = dict(poller.poll(100))  # ms; also the period of the heartbeat check
            if self.auth is not None and self.auth.zap in events:
                self.auth.answer()
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            while self._outbox:
                ident, data = self._outbox.popleft()
                if ident is None:
                    self.pub.send(data)
                else:
                    self.control.send_multipart([ident, data])
            if self.control in events:
                self._drain(self.control, self._on_control)
            if self.rollouts in events:
                self._drain(self.rollouts, self._on_rollout)
            self._check_timeouts()

    def _drain(self, sock, handler, budget: int = 1000) -> None:
        """Read without blocking until empty (much faster than one poll per message)."""
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:  # a bug in one message's handler must not end the run: logged, counted
                self.counters["bad_messages"] += 1
                log.exception("hub: handler failed")

    # ---- control channel ------------------------------------------------------------------------

    def _reply(self, ident: bytes, msg: P.Message, rid: int) -> None:
        data = P.encode(msg, rid)
        if isinstance(msg, P.WeightsChunk):  # tracked: a peer that does not read cannot pile up chunks here
            tracker = self.control.send_multipart([ident, data], copy=False, track=True)
            self._sending.setdefault(ident, []).append(tracker)
        else:
            self.control.send_multipart([ident, data], copy=False)

    def _on_control(self, frames: list[zmq.Frame]) -> None:
        user = user_of(frames[-1]) if self.auth else ""
        if self._muted(user or frames[0].bytes):
            return
        if len(frames) != 2:
            self._bad(f"control: expected 2 frames (identity, message), got {len(frames)}")
            return
        ident, data = frames[0].bytes, frames[1]
        try:
            msg, rid = P.decode(data.buffer, limits=P.FROM_PEER)
        except P.ProtocolError as e:
            self._bad(f"control: {e}")
            self._reply(ident, P.Error(f"bad message: {e}"), 0)
            return
        with self.lock:
            reply = self._handle(msg, ident, user)
        self._reply(ident, reply, rid)

    def _muted(self, source: bytes | str | None) -> bool:
        """Whether `source` (a key, or a control connection) sent more than STRIKES_PER_S bad messages this second:
        the rest of its messages that second are dropped right after they are read, before any decoding. A
        flood costs the hub little; a well-behaved generator never comes near it."""
        self._source = source
        strikes = self._strikes.get(source) if source else None
        if strikes is None or time.monotonic() - strikes[0] >= 1.0 or strikes[1] <= STRIKES_PER_S:
            return False
        self.counters["muted"] += 1
        return True

    def _strike(self) -> None:
        if not self._source:
            return
        now = time.monotonic()
        strikes = self._strikes.setdefault(self._source, [now, 0])
        if now - strikes[0] >= 1.0:
            strikes[:] = [now, 0]
        strikes[1] += 1
        if len(self._strikes) > 4096:  # old sources
            self._strikes = {k: v for k, v in self._strikes.items() if now - v[0] < 1.0}

    def _bad(self, what: str) -> None:
        self.counters["bad_messages"] += 1
        self._strike()
        self._warn("bad", "hub: rejected %s", what)

    def _refuse(self, what: str) -> P.Error:
        self.counters["refused"] += 1
        self._strike()
        self._warn("refused", "hub: refused %s", what)
        return P.Error(what)

    def _handle(self, msg: P.Message, ident: bytes = b"", user: str = "") -> P.Message:
        handler = getattr(self, f"_on_{msg.tag}", None)
        if handler is None:
            self._bad(f"control: unexpected {type(msg).__name__}")
            return P.Error(f"unexpected message {type(msg).__name__} on the control channel")
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
        gen = self.generators.get(msg.generator_id)
        if gen is None:
            return P.Error(f"unknown generator id {msg.generator_id!r}: register again", fatal=True)
        if gen.ident != ident or gen.user != user:
            return self._refuse(f"{type(msg).__name__} for generator {msg.generator_id!r} from a connection that "
                                "did not register it")
        gen.last_seen = time.monotonic()
        return handler(msg)

    def _on_register(self, msg: P.Register, ident: bytes, user: str) -> P.Message:
        problem = _registration_problem(msg)
        if problem:
            return P.Error(f"registration refused: {problem}", stop=True)
        old = self.generators.get(msg.generator_id)
        if old is not None:  # a reconnect under the same id needs the session of its last registration
            if not hmac.compare_digest(old.session, msg.session) or old.user != user:
                return self._refuse(f"Register: generator id {msg.generator_id!r} is registered by another "
                                    "connection (re-registering needs its session)")
            if old.transport == "nccl" and not self.collective.is_ready(old.generator_id):
                self.collective.failed.add(old.generator_id)  # it gave up on its group: auto picks a file now
            self._drop_generator(msg.generator_id, "re-registered")
        elif len(self.generators) >= self.cfg.hub.max_generators:
            return P.Error(f"registration refused: {len(self.generators)} generators are registered "
                           "(hub.max_generators)", stop=True)
        transport = self._pick_transport(msg)
        collective, latest = {}, self._latest()
        if transport == "nccl":
            if self.collective is None:
                return P.Error("weights.transport nccl: this learner has no collective transport", fatal=True)
            loaded = msg.loaded_version if msg.loaded_run == self.run_id else -1  # weights of another run: resend
            collective = self.collective.open(msg.generator_id, 1 + msg.tensor_parallel, loaded)
            latest = {}  # the current version comes by broadcast once the group is joined
        elif self.on_file_join is not None and (self.last_ready is None or self.last_ready.version < self.version):
            self.on_file_join()  # versions were published by broadcast only: make a blob of the newest
        gen = GeneratorInfo(msg.generator_id, msg.host, msg.gpus, msg.pid, next(self._gen_index), transport,
                            time.monotonic(), ident=ident, user=user, session=secrets.token_hex(16),
                            version=msg.loaded_version if msg.loaded_run == self.run_id else -1)
        self.generators[gen.generator_id] = gen
        self._event("register", generator=gen.generator_id, host=gen.host, gpus=gen.gpus, transport=transport,
                    key=user.split(":", 1)[-1], version=self.version,
                    weights=self.version if transport == "nccl" else latest.get("version", 0))
        return P.Welcome(
            run_id=self.run_id, generator_id=gen.generator_id, version=self.version,
            rollouts_endpoint=self._endpoint(self.rollouts_port), weights_endpoint=self._endpoint(self.pub_port),
            transport=transport, heartbeat_s=self.cfg.hub.heartbeat_s, sampling=self._sampling(),
            group_size=self.cfg.trainer.group_size, index=gen.index, latest=latest, collective=collective,
            session=gen.session,
        )

    def _pick_transport(self, msg: P.Register) -> str:
        """`auto`: nccl when this learner has GPUs and the generator reports GPUs other than the learner's
        (and its group never failed); else shm on the same host, zmq across hosts."""
        transport = self.cfg.weights.transport
        if transport != "auto":
            return transport
        same_host = bool(msg.boot_id) and msg.boot_id == self._boot_id
        shares_gpu = same_host and bool(set(msg.gpus.split(",")) & set(self._learner_gpus()))
        if (self.collective is not None and msg.gpus and not shares_gpu
                and msg.generator_id not in self.collective.failed):
            return "nccl"
        return "shm" if same_host else "zmq"

    @staticmethod
    def _learner_gpus() -> list[str]:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return visible.split(",")[:1] if visible else ["0"]  # rank 0's device is the one in the groups

    def _latest(self) -> dict:
        return P.as_dict(self.last_ready) if self.last_ready else {}

    def _endpoint(self, port: int) -> str:
        return self.address.rsplit(":", 1)[0] + f":{port}"

    @property
    def rollouts_address(self) -> str:
        return self._endpoint(self.rollouts_port)

    def _sampling(self) -> dict:
        s = self.cfg.sampling
        return dict(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, ignore_eos=s.ignore_eos)

    def _on_heartbeat(self, msg: P.Heartbeat) -> P.Message:
        gen = self.generators[msg.generator_id]
        gen.version, gen.tokens_per_s = msg.version, msg.tokens_per_s
        if msg.draining and not gen.draining:  # no more broadcasts to it: its engine may already be stopping
            gen.draining = True
            if self.collective is not None:
                self.collective.close(msg.generator_id)
            self._event("drain", generator=msg.generator_id)
        held = set(msg.lease_ids)
        settled = gen.received >= msg.pushed  # every rollout it sent so far is here (PUSH/PULL keeps their order)
        for lease in [lease for lease in self.leases.values() if lease.generator_id == gen.generator_id]:
            if lease.lease_id in held or not settled:
                lease.unreported = 0
                continue
            lease.unreported += 1
            if lease.unreported >= 2:  # two heartbeats in a row: not a heartbeat sent before the lease arrived
                self._expire(lease, "its generator no longer reports it")
        mine = {i for i, lease in self.leases.items() if lease.generator_id == gen.generator_id}
        return P.Ack({"version": self.version, "dead_leases": sorted(held - mine), "latest": self._latest()})

    def _on_lease_request(self, msg: P.LeaseRequest) -> P.Message:
        if self.complete or self.version >= self.cfg.trainer.total_steps:
            return P.Wait("run complete", retry_s=1.0, version=self.version)
        B, k = self.cfg.trainer.batch_size, self.cfg.trainer.max_staleness
        in_flight = self._in_flight()
        still_needed = (self.cfg.trainer.total_steps - self.version) * B - in_flight
        room = min((k + 1) * B - in_flight, still_needed, msg.max_groups, self.cfg.generator.lease_size)
        if room <= 0:
            reason = "waiting for the last steps" if still_needed <= 0 else "staleness window full"
            return P.Wait(reason, retry_s=0.05)
        items = self._lease_items(room, msg.generator_id)
        if not items:
            return P.Wait("dataset exhausted", retry_s=0.5)
        # the first group of this lease is trained at step >= version + in_flight // B at the latest
        min_version = min(self.version, max(0, self.version + in_flight // B - k))
        sampling = self._sampling()
        lease = LeaseState(next(self._lease_ids), msg.generator_id, items, sampling["temperature"], min_version,
                           time.monotonic())
        self.leases[lease.lease_id] = lease
        return P.Lease(lease.lease_id, min_version, list(items.values()), sampling=sampling)

    def _lease_items(self, n: int, gen_id: str) -> dict[Key, P.PromptItem]:
        """Up to n prompts for `gen_id`, tokenised here (a rollout must echo these ids); a prompt no engine can
        take (empty, too long) is rejected without asking one."""
        items: dict[Key, P.PromptItem] = {}
        while len(items) < n:
            keys = self._take_pending(n - len(items), gen_id)
            if not keys:
                break
            for key in keys:
                ids = np.asarray(self.encode(self._prompt(key[1])), dtype=np.int32)
                try:
                    check_prompt_ids(ids, self.shape.vocab_size)
                except Rejected as e:
                    self._reject_prompt(key, "hub", e.detail)
                    continue
                if not len(ids) or len(ids) >= self.cfg.generator.max_model_len:
                    why = "empty after tokenising" if not len(ids) else (
                        f"{len(ids)} tokens leave no room for a completion within generator.max_model_len="
                        f"{self.cfg.generator.max_model_len}")
                    self._reject_prompt(key, "hub", why)
                    continue
                items[key] = P.PromptItem(prompt_id=key[1], epoch=key[0], prompt=self._prompt(key[1]),
                                          columns=self._columns(key[1]), prompt_ids=P.pack_ints(ids))
        return items

    def _prompt(self, pid: int) -> str:
        return str(self.rows[pid][self.cfg.data.prompt_column])

    def _columns(self, pid: int) -> dict:
        row = self.rows[pid]
        return {k: v for k, v in row.items() if k != self.cfg.data.prompt_column}

    def _take_pending(self, n: int, gen_id: str) -> list[Key]:
        """Up to n pending prompts, leaving at the front those this generator failed while another may try."""
        out, skipped = [], []
        principal = self._principal(self.generators[gen_id]) if gen_id in self.generators else gen_id
        while len(out) < n and (self.pending or self._refill()):
            key = self.pending.popleft()
            tried = self.failed_by.get(key)
            if key in self.trained:
                continue
            if tried and principal in tried and not self._everyone(tried):
                skipped.append(key)
                continue
            out.append(key)
        self.pending.extendleft(reversed(skipped))
        return out

    def _refill(self) -> bool:
        epochs = self.cfg.trainer.epochs
        if epochs and self.next_epoch >= epochs:
            return False
        order = list(range(len(self.rows)))
        random.Random(self.cfg.data.seed * 1_000_003 + self.next_epoch).shuffle(order)
        self.pending.extend((self.next_epoch, pid) for pid in order)
        self.next_epoch += 1
        return True

    def _on_weights_applied(self, msg: P.WeightsApplied) -> P.Message:
        self.generators[msg.generator_id].version = msg.version
        self._event("weights_applied", generator=msg.generator_id, version=msg.version, load_ms=msg.load_ms,
                    via=msg.via)
        return P.Ack()

    def _on_weights_fetch(self, msg: P.WeightsFetch) -> P.Message:
        ident = self.generators[msg.generator_id].ident
        chunk = self.cfg.weights.chunk_mb * 2**20
        sending = self._sending[ident] = [t for t in self._sending.get(ident, []) if not t.done]
        if len(sending) >= CHUNKS_IN_FLIGHT:
            return P.Error(f"weights: more than {CHUNKS_IN_FLIGHT} chunks of {self.cfg.weights.chunk_mb} MB in "
                           "flight to this generator")
        blob = self.blobs.get(msg.version)
        if blob is None:
            return P.Error(f"weights version {msg.version} is no longer served (latest: {self.version})")
        end = min(len(blob), msg.offset + min(msg.length, chunk))
        return P.WeightsChunk(msg.version, msg.offset, memoryview(blob)[max(0, msg.offset):end], len(blob))

    def _on_leave(self, msg: P.Leave) -> P.Message:
        if msg.reason:
            log.error("hub: generator %s leaves: %s", msg.generator_id, msg.reason)
        self._drop_generator(msg.generator_id, "left", msg.reason)
        return P.Ack()

    def _on_status_request(self, msg: P.StatusRequest) -> P.Message:
        return P.Ack(self.status())

    def _on_set_request(self, msg: P.SetRequest) -> P.Message:
        try:
            value = apply_runtime_change(self.cfg, msg.key, msg.value)
        except ConfigError as e:
            return P.Error(str(e))
        self._event("set", key=msg.key, value=value, version=self.version)
        with (self.run_dir / "changes.jsonl").open("a") as f:
            f.write(json.dumps({"time": time.time(), "version": self.version, "key": msg.key, "value": value}) + "\n")
        log.info("run-time change: %s = %r (from step %d)", msg.key, value, self.version)
        return P.Ack({"key": msg.key, "value": value, "from_step": self.version})

    # ---- rollouts -------------------------------------------------------------------------------

    def _on_rollout(self, frames: list[zmq.Frame]) -> None:
        user = user_of(frames[-1]) if self.auth else ""
        if self._muted(user or None):  # without keys a rollout's sender is known only once decoded
            return
        try:
            if len(frames) != 1:
                raise P.ProtocolError(f"expected 1 frame, got {len(frames)}")
            msg, _ = P.decode(frames[0].buffer, limits=self.rollout_limits)
            if not isinstance(msg, P.RolloutGroup):
                raise P.ProtocolError(f"unexpected {type(msg).__name__} on the rollouts channel")
        except P.ProtocolError as e:
            self._reject("malformed", str(e), "?")
            return
        key = (msg.epoch, msg.prompt_id)
        with self.lock:
            gen = self.generators.get(msg.generator_id)
            if gen is None:
                self._reject("generator", f"rollout for prompt {key} from unregistered generator id "
                                          f"{msg.generator_id!r}", msg.generator_id)
                return
            if not hmac.compare_digest(gen.session, msg.session) or gen.user != user:
                self._reject("identity", f"rollout for prompt {key} under generator id {msg.generator_id!r} "
                                         "without its session or key", msg.generator_id)
                return
            gen.received += 1
            lease = self.leases.get(msg.lease_id)
            if lease is None or key not in lease.items:
                name = "duplicates" if key in self.trained or self._is_buffered(key) else "unknown_lease"
                self.counters[name] += 1
                self._warn(name, "hub: dropped rollout for prompt %s of %s lease %d (%s)", key,
                           "a known" if lease else "an unknown", msg.lease_id, name)
                return
            if lease.generator_id != gen.generator_id:
                self._reject("lease", f"rollout for prompt {key} of lease {msg.lease_id}, which is leased to "
                                      "another generator", gen.generator_id)
                return
            item = lease.items[key]
            try:
                check_rollout(msg, Expected(item.prompt_ids, lease.temperature, lease.min_version),
                              max(self.version, self.newest), self.shape)
            except Rejected as e:
                self._release(msg.lease_id, key)
                self.pending.appendleft(key)  # its prompt is leased again
                self.counters["requeued"] += 1
                self._reject(e.reason, e.detail, gen.generator_id)
                self.lock.notify_all()
                return
            self._release(msg.lease_id, key)
            self.buffer.append((msg, time.monotonic()))
            self.counters["rollouts"] += 1
            tokens = sum(len(s.token_ids) // 4 for s in msg.samples)
            self.counters["tokens"] += tokens
            gen.groups += 1
            gen.tokens += tokens
            self.lock.notify_all()

    def _reject(self, reason: str, detail: str, gen_id: str) -> None:
        """A rollout that is not trained: counted by reason, logged (rate limited), named in the detail."""
        self.counters["rejected_rollouts"] += 1
        self.counters[f"rejected/{reason}"] = self.counters.get(f"rejected/{reason}", 0) + 1
        self._strike()
        self._warn(f"rejected/{reason}", "hub: rejected a rollout from %s (%s): %s", gen_id, reason, detail)

    def _release(self, lease_id: int, key: Key) -> None:
        """A leased prompt is settled (its group arrived, or failed): off its lease, and the lease once empty."""
        lease = self.leases[lease_id]
        del lease.items[key]
        if not lease.items:
            del self.leases[lease_id]

    def _on_group_failed(self, msg: P.GroupFailed) -> P.Message:
        """A generator could not generate a leased prompt. "engine": lease it again (a few times); "prompt": vLLM
        refused it; "reward": a reward function raised (an error of the run, not of the prompt). The prompt goes
        to another generator while one is there to try it; the fault counts only once confirmed (`_everyone`):
        a confirmed "prompt" (or a third "engine") rejects the prompt for the epoch, a confirmed "reward" counts
        toward hub.max_reward_errors and the prompt is leased again."""
        key = (msg.epoch, msg.prompt_id)
        lease = self.leases.get(msg.lease_id)
        if lease is None or lease.generator_id != msg.generator_id or key not in lease.items:
            return P.Ack({"known": False})
        if msg.kind not in ("engine", "prompt", "reward"):
            return P.Error(f"GroupFailed.kind: {msg.kind!r} is not engine, prompt or reward")
        self._release(msg.lease_id, key)
        self.attempts[key] = self.attempts.get(key, 0) + 1
        tried = self.failed_by.setdefault(key, set())
        tried.add(self._principal(self.generators[msg.generator_id]))
        confirmed = self._everyone(tried)
        if msg.kind == "reward":
            self._reward_error(key, msg, confirmed)
        elif confirmed and (msg.kind == "prompt" or self.attempts[key] >= MAX_ATTEMPTS):
            self._reject_prompt(key, msg.generator_id, msg.reason)
        else:
            self.pending.appendleft(key)
            self.counters["requeued"] += 1
            self._warn("failed", "hub: prompt %s failed on %s (%s: %s); leased again", key, msg.generator_id,
                       msg.kind, msg.reason[:500])
        self.lock.notify_all()
        return P.Ack({"known": True})

    @staticmethod
    def _principal(gen: GeneratorInfo) -> str:
        """Who stands behind a generator: its key with auth.keys (generators sharing a key are one principal),
        else its id (without keys, nothing tells two ids of one local process apart)."""
        return gen.user or gen.generator_id

    def _everyone(self, principals: set[str]) -> bool:
        """A fault confirmed: reported by two principals, or by every one registered (a lone generator)."""
        return len(principals) >= 2 or {self._principal(g) for g in self.generators.values()} <= principals

    def _reject_prompt(self, key: Key, by: str, reason: str) -> None:
        self.counters["rejected_prompts"] += 1
        self.failed_by.pop(key, None)
        self._event("prompt_rejected", generator=by, epoch=key[0], prompt_id=key[1], reason=reason)
        self._warn("prompt_rejected", "hub: prompt %s rejected (%s): %s", key, by, reason)
        limit = self.cfg.hub.max_rejected_prompts
        if self.counters["rejected_prompts"] >= limit:
            self._fail(f"{limit} prompts were rejected (hub.max_rejected_prompts), the last, prompt {key[1]}: "
                       f"{reason}. Check data.prompt_column, the tokenizer and generator.max_model_len")

    def _reward_error(self, key: Key, msg: P.GroupFailed, confirmed: bool) -> None:
        self.pending.appendleft(key)
        self.counters["requeued"] += 1
        self.counters["reward_errors"] += 1
        self._event("reward_error", generator=msg.generator_id, epoch=key[0], prompt_id=key[1], error=msg.reason,
                    confirmed=confirmed)
        self._warn("reward_error", "hub: a reward function failed in %s on prompt %s:\n%s", msg.generator_id, key,
                   msg.reason)
        if not confirmed:  # another generator tries the prompt first
            return
        self.failed_by.pop(key, None)  # the prompt is not at fault: anyone may take it again
        self.confirmed_reward_errors += 1
        limit = self.cfg.hub.max_reward_errors
        if self.confirmed_reward_errors >= limit:
            self._fail(f"reward functions raised {self.confirmed_reward_errors} times (hub.max_reward_errors="
                       f"{limit}); the last, on prompt {key[1]} in {msg.generator_id}:\n{msg.reason}")

    def _fail(self, why: str) -> None:
        with self.lock:
            if not self.failure:
                self.failure = why
                log.error("hub: the run cannot go on: %s", why)
            self.lock.notify_all()

    def _is_buffered(self, key: Key) -> bool:
        return any((g.epoch, g.prompt_id) == key for g, _ in self.buffer) or any(
            (g.epoch, g.prompt_id) == key for g in self.in_step)

    # ---- failures -------------------------------------------------------------------------------

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        with self.lock:
            for gen in list(self.generators.values()):
                if now - gen.last_seen > self.cfg.hub.heartbeat_timeout_s:
                    log.warning("hub: generator %s silent for %.1f s: dropped, its leases re-queued",
                                gen.generator_id, now - gen.last_seen)
                    self._drop_generator(gen.generator_id, "heartbeat timeout")
            for lease in list(self.leases.values()):
                if now - lease.granted > self.cfg.hub.lease_timeout_s:
                    self._expire(lease, f"not returned within hub.lease_timeout_s={self.cfg.hub.lease_timeout_s}")

    def _expire(self, lease: LeaseState, why: str) -> None:
        """A lease goes back to the queue while its generator stays (its late rollouts are dropped as unknown)."""
        keys = list(self.leases.pop(lease.lease_id).items)
        self.pending.extendleft(reversed(keys))
        self.counters["lost_leases"] += 1
        self.counters["requeued"] += len(keys)
        self._event("lease_expired", generator=lease.generator_id, lease=lease.lease_id, prompts=len(keys), reason=why)
        log.warning("hub: lease %d of %s re-queued (%d prompts): %s", lease.lease_id, lease.generator_id, len(keys),
                    why)
        self.lock.notify_all()

    def _drop_generator(self, gen_id: str, why: str, detail: str = "") -> None:
        """Forget a generator (it left, went silent, or re-registers): its leased prompts go back to the
        front of the queue, its process group (nccl) is closed, waiters are woken."""
        gen = self.generators.pop(gen_id, None)
        if gen is not None:
            self._sending.pop(gen.ident, None)
        if self.collective is not None:
            self.collective.close(gen_id)
        n = 0
        for lease_id in [i for i, lease in self.leases.items() if lease.generator_id == gen_id]:
            keys = list(self.leases.pop(lease_id).items)
            self.pending.extendleft(reversed(keys))
            n += len(keys)
        self.counters["requeued"] += n
        self._event("requeue" if why != "left" else "leave", generator=gen_id, reason=detail or why, prompts=n)
        self.lock.notify_all()

    def _event(self, name: str, **fields) -> None:
        with (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps({"time": time.time(), "event": name, **fields}) + "\n")

    def _warn(self, kind: str, fmt: str, *args, per_minute: int = 10) -> None:
        """A warning, at most `per_minute` of one kind a minute (a hostile peer must not flood the log)."""
        now = time.monotonic()
        times = self._logged.setdefault(kind, [])
        times[:] = [t for t in times if now - t < 60]
        if len(times) < per_minute:
            times.append(now)
            log.warning(fmt + ("" if len(times) < per_minute else " (more of these are counted, not logged, for "
                                                                   "a minute)"), *args)

    # ---- learner-thread API ---------------------------------------------------------------------

    def _in_flight(self) -> int:
        return sum(len(lease.items) for lease in self.leases.values()) + len(self.buffer) + len(self.in_step)

    def take_batch(self, step: int) -> tuple[list[P.RolloutGroup], dict]:
        """Block until batch_size groups fresh enough for `step` are buffered; drop and re-queue stale ones."""
        B = self.cfg.trainer.batch_size
        stats = {"staleness/dropped": 0}
        with self.lock:
            while True:
                if self._stopped.is_set():
                    raise HubStopped("hub stopped while the learner waited for rollouts")
                if self.failure:
                    raise HubStopped(self.failure)
                k = self.cfg.trainer.max_staleness
                stale = [(g, t) for g, t in self.buffer if step - behaviour_version(g) > k]
                if stale:
                    self.buffer = [(g, t) for g, t in self.buffer if step - behaviour_version(g) <= k]
                    self.pending.extendleft(reversed([(g.epoch, g.prompt_id) for g, _ in stale]))
                    self.counters["stale_dropped"] += len(stale)
                    stats["staleness/dropped"] += len(stale)
                    log.info("step %d: dropped %d groups older than max_staleness=%d, prompts re-queued",
                             step, len(stale), k)
                if len(self.buffer) >= B:
                    self.buffer.sort(key=lambda gt: (behaviour_version(gt[0]), gt[1]))
                    batch = [g for g, _ in self.buffer[:B]]
                    self.buffer = self.buffer[B:]
                    self.in_step = batch
                    return batch, stats
                if self._exhausted():
                    raise DatasetExhausted(
                        f"dataset exhausted: trainer.epochs={self.cfg.trainer.epochs} over {len(self.rows)} prompts "
                        f"gave {len(self.trained)} trained groups, {len(self.buffer)} left, fewer than a batch of "
                        f"{B}; the run ends at version {self.version} of trainer.total_steps="
                        f"{self.cfg.trainer.total_steps}")
                self.lock.wait(0.5)

    def _exhausted(self) -> bool:
        epochs = self.cfg.trainer.epochs
        return bool(epochs) and self.next_epoch >= epochs and not self.leases and not self.in_step \
            and all(key in self.trained for key in self.pending)

    def finish_step(self, version: int) -> None:
        """The step that produced `version` is done: its groups join the ledger, admission moves on."""
        with self.lock:
            self.trained.update((g.epoch, g.prompt_id) for g in self.in_step)
            self.in_step = []
            self.version, self.newest = version, max(self.newest, version)
            self.lock.notify_all()

    def abandon_step(self) -> None:
        """The step was skipped (not finite): its groups are not trained, their prompts are leased again."""
        with self.lock:
            self.pending.extendleft(reversed([(g.epoch, g.prompt_id) for g in self.in_step]))
            self.counters["requeued"] += len(self.in_step)
            self.counters["skipped_steps"] += 1
            self.in_step = []
            self.lock.notify_all()

    def finish_run(self) -> None:
        """Training is over (all steps, or the dataset ran out): generators hear "run complete" and leave."""
        with self.lock:
            self.complete = True

    def announce(self, ready: P.WeightsReady, blob: bytes | None, to: list[str] | None = None) -> None:
        """Serve `blob` for zmq generators and announce it (any thread: the PUB send happens on the hub's).
        A collective announcement goes to the generators in `to`, the ones the broadcasts will reach; it is
        not the `latest` that file-transport joiners load."""
        with self.lock:
            self.newest = max(self.newest, ready.version)
            if blob is not None:
                self.blobs[ready.version] = blob
                for v in [v for v in self.blobs if v < ready.version - 1]:
                    del self.blobs[v]
            if not ready.collective:
                self.last_ready = ready
                self._outbox.append((None, P.encode(ready)))
            else:  # pushed over the control channel: reliable, and in order with the broadcasts that follow
                data = P.encode(ready)
                self._outbox.extend((self.generators[g].ident, data) for g in to or [] if g in self.generators)
        with self._wake_lock:  # the inproc socket is shared by the learner and publisher threads
            self._wake_tx.send(b"")

    def wants_blobs(self) -> bool:
        """A safetensors blob of each version is needed while some generator uses a file transport, or
        none is registered (the next one may)."""
        with self.lock:
            return not self.generators or any(g.transport != "nccl" for g in self.generators.values())

    def publish(self, version: int, ready: P.WeightsReady, blob: bytes | None) -> None:
        self.finish_step(version)
        self.announce(ready, blob)

    def wait_generators_gone(self, timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: not self.generators, timeout)

    def uses_transport(self, name: str) -> bool:
        with self.lock:
            return any(g.transport == name for g in self.generators.values())

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "run_id": self.run_id, "version": self.version, "max_staleness": self.cfg.trainer.max_staleness,
            "batch_size": self.cfg.trainer.batch_size, "buffer": len(self.buffer), "in_flight": self._in_flight(),
            "pending": len(self.pending), "trained": len(self.trained), "counters": dict(self.counters),
            "failure": self.failure, "authenticated": self.auth is not None,
            "generators": [
                {"id": g.generator_id, "host": g.host, "gpus": g.gpus, "version": g.version,
                 "lag": self.version - g.version if g.version >= 0 else None, "tokens_per_s": g.tokens_per_s,
                 "leases": sum(1 for lease in self.leases.values() if lease.generator_id == g.generator_id),
                 "groups": g.groups, "tokens": g.tokens, "last_heartbeat_s": round(now - g.last_seen, 2),
                 "transport": g.transport, "draining": g.draining}
                for g in self.generators.values()
            ],
        }

    # ---- checkpoint state -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Hub state for a checkpoint taken between steps: leased and buffered prompts count as pending."""
        with self.lock:
            unfinished = [k for lease in self.leases.values() for k in lease.items]
            unfinished += [(g.epoch, g.prompt_id) for g, _ in self.buffer]
            return {"version": self.version, "next_epoch": self.next_epoch,
                    "pending": [list(k) for k in unfinished + list(self.pending)],
                    "trained": sorted(list(k) for k in self.trained), "counters": dict(self.counters)}

    def _restore(self, state: dict) -> None:
        self.next_epoch = state["next_epoch"]
        self.pending = deque(tuple(k) for k in state["pending"])
        self.trained = {tuple(k) for k in state["trained"]}
        self.counters.update(state.get("counters", {}))


def _registration_problem(msg: P.Register) -> str:
    if not GENERATOR_ID.fullmatch(msg.generator_id):
        return f"generator_id {msg.generator_id[:40]!r}: 1-128 characters of letters, digits and ._:-"
    if not msg.host.isprintable() or not msg.boot_id.isprintable():
        return "host and boot_id must be printable"
    if not re.fullmatch(r"[0-9,]*", msg.gpus):
        return f"gpus {msg.gpus[:40]!r}: GPU indices separated by commas"
    if not 1 <= msg.tensor_parallel <= 64 or msg.pid < 0:
        return f"tensor_parallel {msg.tensor_parallel} (1-64) or pid {msg.pid}"
    return ""


def behaviour_version(group: P.RolloutGroup) -> int:
    return min(s.first_version for s in group.samples)
