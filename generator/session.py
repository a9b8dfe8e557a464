"""One registration with the hub (`Session`), and the exceptions that end one.

The generator (generator/service.py) opens a Session once the hub welcomes it and closes it when the registration
ends, however it ends; the next registration starts with a new one. A session holds:

    client      the control channel it registered on (pipeline/client.py); its requests go through `ask`
    welcome     the hub's Welcome: run id, weights transport, heartbeat period, group size, session id
    receiver    the weights receiver the Welcome's transport names (weights/base.py)
    push        the PUSH socket to the hub's rollouts endpoint
    engine      the engine it serves with (the spec's, which only a new registration replaces)

and what the session's tasks share: the versions announced (the weights loop, generator/weights_loop.py), the
engine's version changing, the groups in flight and the leases held (the lease loop, generator/leases.py; the
heartbeats report them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline import protocol as P
from pipeline.client import HubClient
from weights.base import Receiver


class NotRegistered(P.PeerLost):
    """The hub answered a registration with an error that may pass (its id still held by a connection the hub has
    not dropped yet); MAX_REFUSALS in a row end the generator."""


class Reregister(Exception):
    """The hub does not know this generator (it restarted or dropped us): register again."""


class LoadFailed(Reregister):
    """A weights version could not be loaded (a broadcast that timed out, a transport's fault): register again and
    take the version anew. MAX_LOAD_FAILURES in a row end the generator: a failure that comes back each time (an
    engine that refuses the tensors) is not waited out."""


MAX_LOAD_FAILURES = 5  # about 15 s with back-off


class Refused(Exception):
    """The hub refuses this generator or the run failed (Error.stop): leave and exit."""


class LeavingNow(Exception):
    """A second signal: whatever the session waited for was cancelled; it says Leave and the generator exits."""


class EngineDied(Exception):
    """The vLLM engine is dead: leave at once (the hub re-queues the leases) and exit."""


class Rebuild(Exception):
    """The run's config now needs another engine (more adapter slots for a raised trainer.max_staleness): leave,
    returning the leases, build it, register again."""


async def ask(client: HubClient, msg: P.Message, timeout: float | None = None) -> P.Message:
    """A request whose Error reply ends the session: `stop` (refused, or the run failed) or `fatal`
    (register again); other replies, other errors included, go to the caller."""
    reply = await client.request(msg, timeout)
    if isinstance(reply, P.Error) and reply.stop:
        raise Refused(f"the hub refused it: {reply.message}")
    if isinstance(reply, P.Error) and reply.fatal:
        raise Reregister(reply.message)
    return reply


class Session:
    def __init__(self, client: HubClient, welcome: P.Welcome, receiver: Receiver, push: Any, engine: Any):
        """`push`: a connected zmq PUSH socket (anything with `send` and `close`); `engine`: generator/engine.py's."""
        self.client, self.welcome, self.receiver, self.push, self.engine = client, welcome, receiver, push, engine
        self.announced: asyncio.Queue[P.WeightsReady] = asyncio.Queue()  # by the hub, on the control channel
        self.version_changed = asyncio.Condition()  # a version loaded, or leases the hub took back
        self.groups: dict[asyncio.Task, int] = {}  # group task -> lease id
        self.held: dict[int, int] = {}  # lease id -> its groups not yet finished (reported in heartbeats)
        self.pushed = 0  # rollouts sent (heartbeats and the Leave report it)
        self.generating: set[asyncio.Task] = set()  # training groups waiting for their engine's samples
        self.stale: set[asyncio.Task] = set()  # of those, the ones `stop_stale` cancelled

    async def ask(self, msg: P.Message, timeout: float | None = None) -> P.Message:
        return await ask(self.client, msg, timeout)

    def holds(self, version: int) -> bool:
        """The engine holds weights of this run at `version` or newer."""
        return self.engine.run_id == self.welcome.run_id and self.engine.version >= version

    async def version_changes(self) -> None:
        """Wake whatever waits for a version (`version_changed`)."""
        async with self.version_changed:
            self.version_changed.notify_all()

    def stop_stale(self, version: int, k: int) -> int:
        """Cancel the training groups still generating whose samples started under a version more than k older than
        `version` (the engine's, which the learner's is at or past): no step can train them any more
        (pipeline/staleness.py), and each held its room in the window and its engine's time until it came back to be
        dropped. Each reports itself as failed, kind "stale", and the hub leases its prompt again. Returns how many."""
        stopped = 0
        for task in list(self.generating):
            first = self.engine.started_under(task)
            if first is not None and version - first > k and task not in self.stale:
                self.stale.add(task)
                task.cancel()
                stopped += 1
        return stopped

    def cancel_groups(self) -> None:
        for t in list(self.groups):
            t.cancel()

    def engine_dead(self) -> bool:
        return self.engine is not None and self.engine.dead()

    def engine_error(self, e: BaseException | None = None) -> str:
        detail = self.engine.death() if self.engine is not None else ""
        return (f"its vLLM engine died ({type(e).__name__ + ': ' + str(e) if e else 'found dead'}){detail}; the "
                "engine's traceback, if it printed one, is above in this log")

    def raise_if_dead(self, e: Exception) -> None:
        if self.engine_dead():
            raise EngineDied(self.engine_error(e)) from e

    def close(self) -> None:
        """Cancel its groups, end its receiver's hold (nccl's staging) and close the rollouts socket."""
        self.cancel_groups()
        self.groups.clear()
        self.held.clear()
        self.receiver.close()
        self.push.close(linger=2000)
