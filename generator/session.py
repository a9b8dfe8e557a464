from __future__ import annotations

from pipeline import protocol as P


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
