"""The three parts of a weight transport, and what each does by default (nothing): a transport overrides only what
it uses. pipeline/transports.py names each transport's three; weights/__init__.py builds them.

Sender: the learner's side (learner/publisher.py drives it; rank 0 only). Built with the run's config, an
`Announcer` (what it may ask of the hub: the hub is one) and the run id.
Receiver: the generator's side, one per registration (generator/session.py; generator/weights_loop.py drives it): it
meets the learner at `start`, takes each version the hub announces (`apply`) into the engine through the engine's one
swap method, `engine.swap(version, method, args)`, which calls `method` of every vLLM worker between two engine steps
(and `engine.rpc(method, args)` outside swaps), and releases what it holds at `close`.
Worker: a mixin of the vLLM worker extension (generator/worker_ext.py composes one of each transport's): the
methods `swap` and `rpc` name, run inside every worker. They may use the extension's core: `_load_named(named)`
loads (name, tensor) pairs (merging an adapter version first), `_in_step_gap(fn)` runs `fn` between two engine
steps, `_copy_in(manifest, named, buffers)` loads through the recorded copy plan (generator/copyplan.py).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pipeline import protocol as P

if TYPE_CHECKING:
    import torch

    from pipeline.client import HubClient
    from pipeline.config import Config


class Announcer(Protocol):
    """What a sender may ask of the hub (hub/hub.py's Hub is one; the senders get it in place of the hub). Called on
    the hub's thread under its lock (join, leave, on_applied) or on the learner's (the rest)."""

    def announce(self, ready: P.WeightsReady, blob: bytes | bytearray | mmap.mmap | None, to: list[str] | None = None,
                 delta: bytes | None = None, transports: set[str] | None = None) -> None:
        """Push `ready` to the generators it concerns (`to`, or for a file version every one of `transports`), and
        serve `blob` (and its `delta`) for zmq pulls."""

    def push(self, ident: bytes, ready: P.WeightsReady) -> None:
        """Push `ready` to the one generator on connection `ident` (a version right after its Welcome)."""

    def last_file_version(self) -> P.WeightsReady | None:
        """The newest file version announced."""

    def drop(self, generator_id: str, reason: str) -> None:
        """Drop a generator: its leases are re-queued, its next request tells it to register again."""

    def wants_blobs(self, transports: set[str]) -> bool:
        """Some generator of `transports` is registered, or none at all (the next one may be)."""

    def uses_transport(self, name: str) -> bool:
        """Some registered generator uses transport `name`."""


class Engine(Protocol):
    """What a receiver may ask of the generator's engine (generator/engine.py's Engine is one)."""

    staging: bool  # weights.staging: nccl receives each version into buffers of its own where there is room
    last_swap_ms: dict[str, float]  # of the last swap, by phase; a receiver may add its own ("receive")

    async def swap(self, version: int, method: str, *args: Any) -> float:
        """Swap in `version` through every worker's `method` between two engine steps; milliseconds stopped."""
        ...

    async def rpc(self, method: str, *args: Any) -> list:
        """Call every worker's `method` outside a swap; their results."""
        ...


class Sender:
    transports: set[str]  # set by weights.senders: the transports this object serves
    # set by the publisher: latest(fn, background=False) calls fn(version, named) with the newest version's CPU copy
    # (late joiners)
    latest: Callable[..., None] | None = None
    device: torch.device | None = None  # where the publisher packs the buckets it hands over (None: anywhere)

    def __init__(self, cfg: Config, announcer: Announcer, run_id: str) -> None:
        self.announcer, self.run_id = announcer, run_id

    @staticmethod
    def available() -> bool:
        """Usable here, for `weights.transport: auto`."""
        return True

    def join(self, register: P.Register, ident: bytes, version: int) -> P.CollectiveSetup | None:
        """A generator of this transport registers (hub thread, hub lock held): its setup for the Welcome
        (P.CollectiveSetup) or None."""
        return None

    def leave(self, generator_id: str, again: bool = False) -> None:
        """It drains, leaves, or registers again."""

    def begin(self, version: int, plan: list, published_at: float) -> bool:
        """A version is being gathered: True to get its buckets as they are packed."""
        return False

    def bucket(self, flat: torch.Tensor) -> None:
        """One packed bucket (on the learner's device)."""

    def end(self) -> None:
        """After the version's last bucket, or when its publishing failed: release what `begin` took (called on every
        sender whose begin returned True)."""

    def wanted(self) -> bool:
        """Wants the version's CPU copy: `send` runs in the background."""
        return False

    def send(self, version: int, named: list[tuple[str, torch.Tensor]], published_at: float) -> None:
        """The version's CPU copy, (name, tensor) pairs."""

    def on_applied(self, generator_id: str, version: int) -> None:
        """A generator applied a version (hub thread, hub lock held)."""

    def metrics(self) -> dict:
        """Of the last version."""
        return {}

    def shutdown(self) -> None:
        """The run ends: release what lives outside the process."""


class Receiver:
    name = via = ""  # its transport; `via`: the one the last version came by (shm may fall back to zmq)
    in_order = False  # True: every version must be received, in order (a broadcast the learner is sending)

    def __init__(self, client: HubClient | None = None, chunk_bytes: int = 0, generator_id: str = "") -> None:
        self.client, self.chunk, self.generator_id = client, chunk_bytes, generator_id

    def accepts(self, ready: P.WeightsReady) -> bool:
        """An announcement of this transport's kind."""
        return False

    async def start(self, engine: Engine, host: str, welcome: P.Welcome) -> None:
        """Meet the learner once registered (`host`: the hub's)."""

    async def apply(self, ready: P.WeightsReady, engine: Engine) -> float:
        """Take version `ready.version` into the engine; milliseconds the engine stopped generating. Raising
        weights.VersionGone skips the version (a newer one is, or will be, announced); any other error makes the
        generator register again."""
        raise NotImplementedError

    def close(self) -> None:
        """The registration ends: release what `start` and `apply` made."""


class Worker:
    """A transport's methods in every vLLM worker (see the module's docstring)."""

    # what the mixins use of vLLM's worker and of the extension's Core, declared for the type checker: no values, so
    # nothing here shadows theirs (the mixins come before Core in WeightLoader's bases)
    device: Any  # vLLM's worker's torch.device
    _copies: list | None  # Core's copy plan: None records it anew
    _load_named: Callable[[list], None]
    _in_step_gap: Callable[[Callable[[], Any]], Any]
    _copy_in: Callable[[list, list, list | None], str]
