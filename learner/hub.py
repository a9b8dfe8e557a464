"""The hub: the learner's front door for generators. Runs in its own thread on rank 0.

Sockets (the hub binds, generators connect):
  control  ROUTER  Register/Heartbeat/LeaseRequest/WeightsApplied/WeightsFetch/Leave/Status/Set
  rollouts PULL    RolloutGroup, one per prompt
  weights  PUB     WeightsReady announcements
Only the hub thread touches these sockets; the learner thread talks to the hub through `take_batch`
and `publish` (a lock, a condition and an inproc wake-up socket), so the hub keeps answering
heartbeats and leases while a training step runs.

Every prompt of an epoch lives in exactly one place: pending (a deque), a lease, the buffer of
received groups, the step being trained, or the trained ledger. Admission keeps the groups in flight
(leased + buffered + in the current step) at most (max_staleness + 1) x batch_size.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from pipeline import protocol as P
from pipeline.config import Config, ConfigError, apply_runtime_change
from pipeline.transports import host_identity

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (epoch, prompt_id)


@dataclass
class GeneratorInfo:
    generator_id: str
    host: str
    gpus: str
    pid: int
    index: int
    transport: str
    last_seen: float
    ident: bytes = b""  # its ROUTER identity: where pushed (unsolicited) messages go
    version: int = -1
    tokens_per_s: float = 0.0
    groups: int = 0
    tokens: int = 0  # rollout tokens received from it
    draining: bool = False  # told us it is finishing its groups before it leaves
    joined_at: float = field(default_factory=time.time)


@dataclass
class LeaseState:
    lease_id: int
    generator_id: str
    items: dict[Key, P.PromptItem]  # not yet received


class HubStopped(RuntimeError):
    """The hub was stopped while the learner waited on it, or the run cannot go on (the message says why)."""


MAX_ATTEMPTS = 3  # a prompt whose group failed this often in engines is rejected like an invalid one


class Hub:
    def __init__(self, cfg: Config, rows: list[dict], run_dir: Path, run_id: str, version: int = 0,
                 state: dict | None = None, collective=None):
        self.cfg, self.rows, self.run_dir, self.run_id = cfg, rows, run_dir, run_id
        self.collective = collective  # learner.collective.CollectivePeers for the nccl transport
        self.on_file_join = None  # callable(): a file-transport generator needs a blob of the newest version
        self.version = version
        self.lock = threading.Condition()
        self.generators: dict[str, GeneratorInfo] = {}
        self.leases: dict[int, LeaseState] = {}
        self.pending: deque[Key] = deque()
        self.buffer: list[tuple[P.RolloutGroup, float]] = []
        self.in_step: list[P.RolloutGroup] = []
        self.trained: set[Key] = set()
        self.next_epoch = 0
        self.counters = dict(bad_messages=0, unknown_lease=0, duplicates=0, stale_dropped=0, requeued=0,
                             rollouts=0, tokens=0, rejected_prompts=0)
        self.attempts: dict[Key, int] = {}  # engine failures per prompt (leased again up to MAX_ATTEMPTS)
        self.failure = ""  # why the run cannot go on: the learner's take_batch raises it
        self.last_ready: P.WeightsReady | None = None
        self.blobs: dict[int, bytes] = {}  # zmq transport: the latest safetensors blobs by version
        # lease ids never repeat across learner restarts: a late rollout for an old lease is recognised
        self._lease_ids = itertools.count(random.SystemRandom().randrange(1, 2**40) * 1000)
        self._gen_index = itertools.count()
        self._outbox: deque[tuple[bytes | None, bytes]] = deque()  # (ROUTER identity or None for PUB, message)
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
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.control.setsockopt(zmq.MAXMSGSIZE, 4 * hub.max_message_mb * 2**20)  # safety net under decode's limit
        self.control.setsockopt(zmq.LINGER, 0)
        host = hub.host
        if hub.port:
            self.control.bind(f"tcp://{host}:{hub.port}")
            self.port = hub.port
        else:
            self.port = self.control.bind_to_random_port(f"tcp://{host}")
        self.rollouts = self.ctx.socket(zmq.PULL)
        self.rollouts.setsockopt(zmq.RCVHWM, 10_000)
        self.rollouts.setsockopt(zmq.MAXMSGSIZE, 4 * hub.max_message_mb * 2**20)
        self.rollouts.setsockopt(zmq.LINGER, 0)
        self.rollouts_port = self.rollouts.bind_to_random_port(f"tcp://{host}")
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://hub-wake-{id(self)}")
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://hub-wake-{id(self)}")
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("hub binds %s: reachable from other hosts and unauthenticated (no CURVE keys configured)", host)

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.cfg.hub.host in ("0.0.0.0", "*") else self.cfg.hub.host
        return f"tcp://{host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="hub", daemon=True)
        self._thread.start()
        log.info("hub listening on %s", self.address)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._wake_lock:
            self._wake_tx.send(b"")
        self._thread.join(timeout=5)
        with self.lock:
            self.lock.notify_all()
        for s in (self.control, self.rollouts, self.pub, self._wake_rx, self._wake_tx):
            s.close(linger=0)
        self.ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for s in (self.control, self.rollouts, self._wake_rx):
            poller.register(s, zmq.POLLIN)
        while not self._stopped.is_set():
            events = dict(poller.poll(100))  # ms; also the period of the heartbeat check
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
            self._check_heartbeats()

    def _drain(self, sock, handler, budget: int = 1000) -> None:
        """Read without blocking until empty (much faster than one poll per message)."""
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:  # a bug in a handler must not kill the hub thread
                log.exception("hub: handler failed")

    # ---- control channel ------------------------------------------------------------------------

    def _reply(self, ident: bytes, msg: P.Message, rid: int) -> None:
        self.control.send_multipart([ident, P.encode(msg, rid)], copy=False)

    def _on_control(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._bad(f"control: expected 2 frames (identity, message), got {len(frames)}")
            return
        ident, data = frames
        try:
            msg, rid = P.decode(data, limit=self.cfg.hub.max_message_mb * 2**20)
        except P.ProtocolError as e:
            self._bad(f"control: {e}")
            self._reply(ident, P.Error(f"bad message: {e}"), 0)
            return
        with self.lock:
            reply = self._handle(msg)
            gen = self.generators.get(getattr(msg, "generator_id", None))
            if gen is not None:
                gen.ident = ident
        self._reply(ident, reply, rid)

    def _bad(self, what: str) -> None:
        self.counters["bad_messages"] += 1
        log.warning("hub: rejected %s", what)

    def _handle(self, msg: P.Message) -> P.Message:
        handler = getattr(self, f"_on_{msg.tag}", None)
        if handler is None:
            return P.Error(f"unexpected message {type(msg).__name__} on the control channel")
        gen_id = getattr(msg, "generator_id", None)
        if gen_id is not None and not isinstance(msg, P.Register):
            gen = self.generators.get(gen_id)
            if gen is None:
                return P.Error(f"unknown generator id {gen_id!r}: register again", fatal=True)
            gen.last_seen = time.monotonic()
        return handler(msg)

    def _on_register(self, msg: P.Register) -> P.Message:
        old = self.generators.get(msg.generator_id)
        if old is not None:  # a reconnect under the same id: its old leases are void
            if old.transport == "nccl" and not self.collective.is_ready(old.generator_id):
                self.collective.failed.add(old.generator_id)  # it gave up on its group: auto picks a file now
            self._drop_generator(msg.generator_id, "re-registered")
        transport = self._pick_transport(msg)
        collective, latest = {}, self._latest()
        if transport == "nccl":
            if self.collective is None:
                return P.Error("weights.transport nccl: this learner has no collective transport", fatal=True)
            collective = self.collective.open(msg.generator_id, 1 + msg.tensor_parallel, msg.loaded_version)
            latest = {}  # the current version comes by broadcast once the group is joined
        elif self.on_file_join is not None and (self.last_ready is None or self.last_ready.version < self.version):
            self.on_file_join()  # versions were published by broadcast only: make a blob of the newest
        gen = GeneratorInfo(msg.generator_id, msg.host, msg.gpus, msg.pid, next(self._gen_index), transport,
                            time.monotonic(), version=msg.loaded_version)
        self.generators[gen.generator_id] = gen
        self._event("register", generator=gen.generator_id, host=gen.host, gpus=gen.gpus, transport=transport,
                    version=self.version, weights=self.version if transport == "nccl" else latest.get("version", 0))
        return P.Welcome(
            run_id=self.run_id, generator_id=gen.generator_id, version=self.version,
            rollouts_endpoint=self._endpoint(self.rollouts_port), weights_endpoint=self._endpoint(self.pub_port),
            transport=transport, heartbeat_s=self.cfg.hub.heartbeat_s, sampling=self._sampling(),
            group_size=self.cfg.trainer.group_size, index=gen.index, latest=latest, collective=collective,
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
        dead = [i for i in msg.lease_ids if i not in self.leases]
        return P.Ack({"version": self.version, "dead_leases": dead, "latest": self._latest()})

    def _on_lease_request(self, msg: P.LeaseRequest) -> P.Message:
        B, k = self.cfg.trainer.batch_size, self.cfg.trainer.max_staleness
        in_flight = self._in_flight()
        still_needed = (self.cfg.trainer.total_steps - self.version) * B - in_flight
        room = min((k + 1) * B - in_flight, still_needed, msg.max_groups, self.cfg.generator.lease_size)
        if self.version >= self.cfg.trainer.total_steps:
            return P.Wait("run complete", retry_s=1.0, version=self.version)
        if room <= 0:
            reason = "waiting for the last steps" if still_needed <= 0 else "staleness window full"
            return P.Wait(reason, retry_s=0.05)
        keys = self._take_pending(room)
        if not keys:
            return P.Wait("dataset exhausted", retry_s=0.5)
        # the first group of this lease is trained at step >= version + in_flight // B at the latest
        min_version = min(self.version, max(0, self.version + in_flight // B - k))
        items = {key: P.PromptItem(prompt_id=key[1], epoch=key[0], prompt=self._prompt(key[1]),
                                   columns=self._columns(key[1])) for key in keys}
        lease = LeaseState(next(self._lease_ids), msg.generator_id, items)
        self.leases[lease.lease_id] = lease
        return P.Lease(lease.lease_id, min_version, list(items.values()), sampling=self._sampling())

    def _prompt(self, pid: int) -> str:
        return str(self.rows[pid][self.cfg.data.prompt_column])

    def _columns(self, pid: int) -> dict:
        row = self.rows[pid]
        return {k: v for k, v in row.items() if k != self.cfg.data.prompt_column}

    def _take_pending(self, n: int) -> list[Key]:
        out = []
        while len(out) < n:
            if not self.pending and not self._refill():
                break
            key = self.pending.popleft()
            if key not in self.trained:
                out.append(key)
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
        blob = self.blobs.get(msg.version)
        if blob is None:
            return P.Error(f"weights version {msg.version} is no longer served (latest: {self.version})")
        end = min(len(blob), msg.offset + msg.length)
        return P.WeightsChunk(msg.version, msg.offset, blob[msg.offset:end], len(blob))

    def _on_leave(self, msg: P.Leave) -> P.Message:
        self._drop_generator(msg.generator_id, "left")
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

    def _on_rollout(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 1:
                raise P.ProtocolError(f"expected 1 frame, got {len(frames)}")
            msg, _ = P.decode(frames[0], limit=self.cfg.hub.max_message_mb * 2**20)
            if not isinstance(msg, P.RolloutGroup):
                raise P.ProtocolError(f"unexpected {type(msg).__name__} on the rollouts channel")
            P.check_rollout(msg, self.cfg.trainer.group_size)
        except P.ProtocolError as e:
            self._bad(f"rollout: {e}")
            return
        key = (msg.epoch, msg.prompt_id)
        with self.lock:
            lease = self.leases.get(msg.lease_id)
            if lease is None or key not in lease.items:
                name = "duplicates" if key in self.trained or self._is_buffered(key) else "unknown_lease"
                self.counters[name] += 1
                log.warning("hub: dropped rollout for prompt %s of %s lease %d (%s)", key,
                            "a known" if lease else "an unknown", msg.lease_id, name)
                return
            self._release(msg.lease_id, key)
            self.buffer.append((msg, time.monotonic()))
            self.counters["rollouts"] += 1
            tokens = sum(len(s.token_ids) // 4 for s in msg.samples)
            self.counters["tokens"] += tokens
            gen = self.generators.get(msg.generator_id)
            if gen is not None:
                gen.groups += 1
                gen.tokens += tokens
            self.lock.notify_all()

    def _release(self, lease_id: int, key: Key) -> None:
        """A leased prompt is settled (its group arrived, or failed): off its lease, and the lease once empty."""
        lease = self.leases[lease_id]
        del lease.items[key]
        if not lease.items:
            del self.leases[lease_id]

    def _on_group_failed(self, msg: P.GroupFailed) -> P.Message:
        """A generator could not generate a leased prompt: lease it again (an engine failure, a few times) or
        reject it (vLLM refused the prompt); too many rejections stop the run with the reason."""
        key = (msg.epoch, msg.prompt_id)
        lease = self.leases.get(msg.lease_id)
        if lease is None or lease.generator_id != msg.generator_id or key not in lease.items:
            return P.Ack({"known": False})
        self._release(msg.lease_id, key)
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if msg.retry and self.attempts[key] < MAX_ATTEMPTS:
            self.pending.appendleft(key)
            self.counters["requeued"] += 1
            log.warning("hub: prompt %s failed on %s (%s); leased again", key, msg.generator_id, msg.reason)
        else:
            self.counters["rejected_prompts"] += 1
            self._event("prompt_rejected", generator=msg.generator_id, epoch=msg.epoch, prompt_id=msg.prompt_id,
                        reason=msg.reason)
            log.warning("hub: prompt %s rejected by %s: %s", key, msg.generator_id, msg.reason)
            limit = self.cfg.hub.max_rejected_prompts
            if self.counters["rejected_prompts"] >= limit and not self.failure:
                self.failure = (f"{limit} prompts were rejected by the generators (hub.max_rejected_prompts), the "
                                f"last, prompt {msg.prompt_id}: {msg.reason}. Check data.prompt_column, the "
                                "tokenizer and generator.max_model_len")
                log.error("hub: %s", self.failure)
        self.lock.notify_all()
        return P.Ack({"known": True})

    def _is_buffered(self, key: Key) -> bool:
        return any((g.epoch, g.prompt_id) == key for g, _ in self.buffer) or any(
            (g.epoch, g.prompt_id) == key for g in self.in_step)

    # ---- failures -------------------------------------------------------------------------------

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        with self.lock:
            for gen in list(self.generators.values()):
                if now - gen.last_seen > self.cfg.hub.heartbeat_timeout_s:
                    log.warning("hub: generator %s silent for %.1f s: dropped, its leases re-queued",
                                gen.generator_id, now - gen.last_seen)
                    self._drop_generator(gen.generator_id, "heartbeat timeout")

    def _drop_generator(self, gen_id: str, why: str) -> None:
        """Forget a generator (it left, went silent, or re-registers): its leased prompts go back to the
        front of the queue, its process group (nccl) is closed, waiters are woken."""
        self.generators.pop(gen_id, None)
        if self.collective is not None:
            self.collective.close(gen_id)
        n = 0
        for lease_id in [i for i, lease in self.leases.items() if lease.generator_id == gen_id]:
            keys = list(self.leases.pop(lease_id).items)
            self.pending.extendleft(reversed(keys))
            n += len(keys)
        self.counters["requeued"] += n
        self._event("requeue" if why != "left" else "leave", generator=gen_id, reason=why, prompts=n)
        self.lock.notify_all()

    def _event(self, name: str, **fields) -> None:
        with (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps({"time": time.time(), "event": name, **fields}) + "\n")

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
                self.lock.wait(0.5)

    def finish_step(self, version: int) -> None:
        """The step that produced `version` is done: its groups join the ledger, admission moves on."""
        with self.lock:
            self.trained.update((g.epoch, g.prompt_id) for g in self.in_step)
            self.in_step = []
            self.version = version
            self.lock.notify_all()

    def announce(self, ready: P.WeightsReady, blob: bytes | None, to: list[str] | None = None) -> None:
        """Serve `blob` for zmq generators and announce it (any thread: the PUB send happens on the hub's).
        A collective announcement goes to the generators in `to`, the ones the broadcasts will reach; it is
        not the `latest` that file-transport joiners load."""
        with self.lock:
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


def behaviour_version(group: P.RolloutGroup) -> int:
    return min(s.first_version for s in group.samples)
