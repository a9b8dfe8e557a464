"""Async request/reply client of the hub's control channel (DEALER socket, request ids).

One reader task dispatches replies to the futures of their requests, so weight chunks, leases and
heartbeats can be in flight at once. A request that is not sent and answered within `timeout` raises
`PeerLost` (the send counts: a DEALER with no connection to send on waits in it); so does every waiting request
when the client is closed. `last_reply` is when the hub last answered (time.monotonic). The socket's routing id
is a random secret of this client, so a reconnect after a network hiccup is still the connection that
registered; with keys the socket is a CURVE client of the hub (pipeline/security.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time

import zmq
import zmq.asyncio

from pipeline import protocol as P
from pipeline.security import ClientKeys, secure_client

log = logging.getLogger(__name__)


class HubClient:
    def __init__(self, address: str, timeout: float = 10.0, ctx: zmq.asyncio.Context | None = None,
                 keys: ClientKeys | None = None):
        self.address, self.timeout = address, timeout
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, b"g" + secrets.token_bytes(15))  # ids starting with 0 are zmq's
        secure_client(self.sock, keys)
        self.sock.connect(address)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.pushed: asyncio.Queue = asyncio.Queue()  # messages the hub sent unasked (request id 0)
        self.last_reply = float("-inf")  # time.monotonic() of the hub's last message
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            data = await self.sock.recv()
            try:
                msg, rid = P.decode(data, limits=P.FROM_HUB)
            except P.SchemaMismatch as e:  # another release: the request it answers fails with it
                fut = self._waiting.pop(e.rid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(e)
                continue
            except P.ProtocolError as e:
                log.warning("hub sent a bad reply: %s", e)
                continue
            self.last_reply = time.monotonic()
            if rid == 0 and not isinstance(msg, P.Error):
                self.pushed.put_nowait(msg)
                continue
            fut = self._waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def request(self, msg: P.Message, timeout: float | None = None) -> P.Message:
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            # one deadline for the send and the reply: a send can wait for ever (no connection to send on, a
            # handshake that never completes), and a generator whose every request waited there fell silent for good
            async with asyncio.timeout(timeout or self.timeout):
                await self.sock.send(P.encode(msg, rid))
                return await fut
        except TimeoutError:
            raise P.PeerLost(f"no reply from the hub at {self.address} to {type(msg).__name__} "
                             f"within {timeout or self.timeout} s") from None
        finally:
            self._waiting.pop(rid, None)

    def close(self) -> None:
        self._reader.cancel()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(P.PeerLost("client closed"))
        self._waiting.clear()
        self.sock.close(linger=0)


def request_once(address: str, msg: P.Message, timeout: float = 5.0, keys: ClientKeys | None = None) -> P.Message:
    """Synchronous one-shot request (for `pipeline status` / `pipeline set`; with keys: an operator's)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(sock, keys)
        sock.connect(address)
        sock.send(P.encode(msg, 1))
        if not sock.poll(int(timeout * 1000)):
            hint = " (with auth.keys the learner drops connections whose key it does not list)" if keys else ""
            raise P.PeerLost(f"no reply from the learner at {address} within {timeout} s{hint}")
        reply, _ = P.decode(sock.recv(), limits=P.FROM_HUB)
        return reply
    finally:
        sock.close(linger=0)
        ctx.term()
