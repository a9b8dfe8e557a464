"""The hub's sockets and thread: bind, poll, decode, dispatch, reply, push. What a message does is the hub's.

Sockets (the hub binds, generators connect; CURVE servers when `auth.keys` is set, pipeline/security.py):
  control  ROUTER  requests from generators and operators, replies, and messages pushed to a generator
  rollouts PULL    RolloutGroup, one per prompt
Only the server's thread touches them; other threads push through `push` (an outbox and an inproc wake-up
socket). Decoding is bounded (pipeline/codec.py), and a source (a key, else a control connection) that sent
more than STRIKES_PER_S bad messages in the current second is muted: the rest of its messages that second are
dropped right after they are read, before any decoding. A failure of the thread itself goes to `on_failure`.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Protocol

import zmq

from pipeline import protocol as P
from pipeline import trace
from pipeline.netutil import local_address
from pipeline.security import ServerAuth, user_of

log = logging.getLogger(__name__)

STRIKES_PER_S = 20  # bad messages from one source in a second, past which its messages are dropped undecoded
ROLLOUTS_PER_TURN = 32  # rollouts read between two looks at the control socket: a request waits behind no more
TICK_S = 0.05  # how often the handler's timeout checks run while messages keep coming (they walk every generator)


class Handler(Protocol):
    """What the server hands its messages to (hub/hub.py's Hub is one). Called on the server's thread."""

    def control(self, msg: P.Message, ident: bytes, user: str) -> P.Message:
        """A request on control connection `ident`; the reply."""
        ...

    def rollout(self, msg: P.RolloutGroup, user: str) -> None:
        """A group from the rollouts socket (`user`: its connection's user id, "" without keys)."""

    def malformed(self, what: str, rollout: bool) -> None:
        """A message that could not be decoded or handled (counted)."""

    def tick(self) -> None:
        """Every TICK_S to 100 ms: the timeout checks."""

    def failed(self, why: str) -> None:
        """The server's thread failed (`why`: its traceback): the run cannot go on."""


class Server:
    def __init__(self, host: str, port: int, auth: ServerAuth | None, rollout_limits: P.Limits, handler: Handler,
                 counters: dict[str, int]) -> None:
        """`counters["muted"]` counts what was dropped."""
        self.host, self.auth, self.rollout_limits, self.handler = host, auth, rollout_limits, handler
        self.counters = counters
        self.busy = trace.Sums()  # seconds this thread spent decoding and handling, by message (the learner's record)
        self._outbox: deque[tuple[bytes, bytes]] = deque()  # (ROUTER identity, message)
        self._sending: dict[bytes, list] = {}  # ROUTER identity -> trackers of weight chunks not yet sent
        self._strikes: dict[bytes | str, list] = {}  # source -> [second, bad messages]
        self._source: bytes | str | None = None  # of the message being handled
        self._stopped = threading.Event()
        self._wake_lock = threading.Lock()
        self.ctx = zmq.Context()
        if auth is not None:  # before any socket binds: a CURVE server without a ZAP handler admits anyone
            auth.bind_zap(self.ctx)
            counters.setdefault("unlisted_keys", 0)  # handshakes refused: nothing of theirs reaches the hub
        # a message past the decoder's limit gets an error reply; past twice that, zmq drops the connection
        self.control = self._socket(zmq.ROUTER, 2 * P.FROM_PEER.bytes)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.control.setsockopt(zmq.SNDHWM, 1000)  # replies are small (weight chunks are counted apart)
        self.control.setsockopt(zmq.RCVHWM, 256)
        if port:
            self.control.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.control.bind_to_random_port(f"tcp://{host}")
        self.rollouts = self._socket(zmq.PULL, rollout_limits.bytes)
        self.rollouts.setsockopt(zmq.RCVHWM, 10_000)
        self.rollouts_port = self.rollouts.bind_to_random_port(f"tcp://{host}")
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://hub-wake-{id(self)}")
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://hub-wake-{id(self)}")

    def _socket(self, kind: int, max_bytes: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # zmq drops the connection of a peer that sends more
        if self.auth is not None:
            self.auth.secure_server(sock)
        return sock

    @property
    def address(self) -> str:
        return local_address(self.host, self.port)

    def endpoint(self, port: int) -> str:
        return self.address.rsplit(":", 1)[0] + f":{port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="hub", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.wake()
        if hasattr(self, "_thread"):
            self._thread.join(timeout=5)
        for s in (self.control, self.rollouts, self._wake_rx, self._wake_tx, self.auth.zap if self.auth else None):
            if s is not None:
                s.close(linger=0)
        self.ctx.term()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def push(self, ident: bytes, data: bytes) -> None:
        """Send `data` to one control connection, unasked (any thread; sent by the server's, after any reply
        being made now)."""
        self._outbox.append((ident, data))

    def wake(self) -> None:
        with self._wake_lock:  # the inproc socket is shared by the learner's and the publisher's threads
            self._wake_tx.send(b"")

    def chunks_in_flight(self, ident: bytes) -> int:
        sending = self._sending[ident] = [t for t in self._sending.get(ident, []) if not t.done]
        return len(sending)

    def forget(self, ident: bytes) -> None:
        self._sending.pop(ident, None)

    # ---- the thread ---------------------------------------------------------------------------------

    def _serve(self) -> None:
        """A bug outside the handlers of single messages ends the run with its traceback: the learner, waiting
        for a batch, raises it instead of waiting forever."""
        try:
            self._loop()
        except Exception:
            log.exception("hub: the hub thread failed")
            self.handler.failed(f"the hub thread failed:\n{traceback.format_exc()}")

    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in (self.control, self.rollouts, self._wake_rx, self.auth.zap if self.auth else None):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        next_tick = 0.0
        while not self._stopped.is_set():
            events = dict(poller.poll(100))  # ms; also the longest time between two timeout checks
            if self.auth is not None and self.auth.zap in events:
                self.counters["unlisted_keys"] += self.auth.answer()
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            while self._outbox:
                self.control.send_multipart(self._outbox.popleft())
            if self.control in events:
                self._drain(self.control, self._on_control)
            if self.rollouts in events:  # a turn's worth: the next poll comes back at once while more wait
                self._drain(self.rollouts, self._on_rollout, ROLLOUTS_PER_TURN)
            if (now := time.monotonic()) >= next_tick:
                self.handler.tick()
                next_tick = now + TICK_S

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None], budget: int = 1000) -> None:
        """Read without blocking until empty (much faster than one poll per message)."""
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # a bug in one message's handler must not end the run: logged, counted
                self.handler.malformed("a message its handler failed on (a bug: the traceback follows)", False)
                log.exception("hub: handler failed")

    def _on_control(self, frames: list[zmq.Frame]) -> None:
        user = user_of(frames[-1]) if self.auth else ""
        if self._muted(user or frames[0].bytes):
            return
        if len(frames) != 2:
            self.handler.malformed(f"control: expected 2 frames (identity, message), got {len(frames)}", False)
            return
        ident, data = frames[0].bytes, frames[1]
        try:
            with trace.span("decode", "hub", self.busy):
                msg, rid = P.decode(data.buffer, limits=P.FROM_PEER)
        except P.ProtocolError as e:
            self.handler.malformed(f"control: {e}", False)
            self.reply(ident, P.Error(f"bad message: {e}", stop=isinstance(e, P.SchemaMismatch)),
                       getattr(e, "rid", 0))
            return
        with trace.span(msg.tag, "hub", self.busy):  # lease_request: admission; heartbeat, weights_applied, ...
            reply = self.handler.control(msg, ident, user)
        self.reply(ident, reply, rid)

    def _on_rollout(self, frames: list[zmq.Frame]) -> None:
        user = user_of(frames[-1]) if self.auth else ""
        if self._muted(user or None):  # without keys a rollout's sender is known only once decoded
            return
        try:
            if len(frames) != 1:
                raise P.ProtocolError(f"expected 1 frame, got {len(frames)}")
            with trace.span("decode", "hub", self.busy):
                msg, _ = P.decode(frames[0].buffer, limits=self.rollout_limits)
            if not isinstance(msg, P.RolloutGroup):
                raise P.ProtocolError(f"unexpected {type(msg).__name__} on the rollouts channel")
        except P.ProtocolError as e:
            self.handler.malformed(str(e), True)
            return
        with trace.span("rollout", "hub", self.busy):  # validate, then buffer (or score: an evaluation's)
            self.handler.rollout(msg, user)

    def reply(self, ident: bytes, msg: P.Message, rid: int) -> None:
        data = P.encode(msg, rid)
        if isinstance(msg, P.WeightsChunk):  # tracked: a peer that does not read cannot pile up chunks here
            tracker = self.control.send_multipart([ident, data], copy=False, track=True)
            self._sending.setdefault(ident, []).append(tracker)
        else:
            self.control.send_multipart([ident, data], copy=False)

    # ---- muting -------------------------------------------------------------------------------------

    def _muted(self, source: bytes | str | None) -> bool:
        self._source = source
        strikes = self._strikes.get(source) if source else None
        if strikes is None or time.monotonic() - strikes[0] >= 1.0 or strikes[1] <= STRIKES_PER_S:
            return False
        self.counters["muted"] += 1
        return True

    def strike(self) -> None:
        """The message being handled was bad: one strike against its source."""
        if not self._source:
            return
        now = time.monotonic()
        strikes = self._strikes.setdefault(self._source, [now, 0])
        if now - strikes[0] >= 1.0:
            strikes[:] = [now, 0]
        strikes[1] += 1
        if len(self._strikes) > 4096:  # old sources
            self._strikes = {k: v for k, v in self._strikes.items() if now - v[0] < 1.0}
