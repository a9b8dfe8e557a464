"""The generator registry: who is registered, bound to which connection and key, and who stands behind it.

A generator id is bound at registration to the connection that registered it (its ROUTER identity), to its
CURVE key (with `auth.keys`) and to a secret session its rollouts carry; a message about a generator from
anywhere else is refused. Re-registering under a live id needs that session. A fault that could end the run
counts only when confirmed by principals: two of them, or every one registered (a lone generator). A
principal is a generator's key (generators sharing a key are one), else its id: without keys nothing tells
two ids of one local process apart. One key registers at most hub.max_generators_per_key generators. What a
generator last reported (its version, its progress) is kept here; the hub checks it first.
"""

from __future__ import annotations

import hmac
import itertools
import re
import secrets
import time
from dataclasses import dataclass, field

from pipeline import protocol as P

GENERATOR_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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
    rejected: int = 0  # rollouts of its own leases that were invalid (hub/validation.py)
    joined_at: float = field(default_factory=time.time)
    on_learner_gpus: bool = False  # it shares a GPU with a learner rank (hub/serving.py)
    applied: int = -1  # the last version it said it loaded (WeightsApplied): only a new one is journaled
    generated: int = 0  # its last Heartbeat.generated: a count that moves is progress
    adapter_slots: int = 0  # generator.lora_mode adapter: adapters its engine serves at once (Register)
    stage_s: dict = field(default_factory=dict)  # its last Heartbeat.stage_s: seconds per stage since it started
    progress_at: float = field(default_factory=time.monotonic)  # tokens, a group, a failed group, a weights load
    stalled: bool = False  # its leases were taken back for want of progress: one group a lease until it progresses
    leaving: tuple[int, float, str] | None = None  # it said Leave with rollouts still on their way: (rollouts it
    # sent, until when they are waited for, its reason); dropped once they are in, or then

    @property
    def principal(self) -> str:
        return self.user or self.generator_id


class Registry:
    def __init__(self, max_generators: int, max_per_key: int):
        self.max_generators, self.max_per_key = max_generators, max_per_key
        self.generators: dict[str, GeneratorInfo] = {}
        self._index = itertools.count()
        self._quarantined: dict[str, tuple[float, str]] = {}  # principal -> (until, why)
        self._active: set[str] | None = None  # `active_principals()` until a change

    def refusal(self, msg: P.Register, user: str) -> tuple[str, bool]:
        """Why `msg` may not register (`""`: it may), and whether that is an attempt to speak for another."""
        problem = registration_problem(msg)
        if problem:
            return f"registration refused: {problem}", False
        if why := self.quarantined(user or msg.generator_id):
            return f"registration refused: {why}", False
        old = self.generators.get(msg.generator_id)
        if old is not None:
            if not hmac.compare_digest(old.session, msg.session) or old.user != user:
                return (f"Register: generator id {msg.generator_id!r} is registered by another connection "
                        "(re-registering needs its session)"), True
        elif len(self.generators) >= self.max_generators:
            return f"registration refused: {len(self.generators)} generators are registered (hub.max_generators)", \
                False
        elif user and sum(g.user == user for g in self.generators.values()) >= self.max_per_key:
            # one key cannot take every slot (without keys each id is its own principal: nothing to count)
            return (f"registration refused: {self.max_per_key} generators are registered under this key "
                    "(hub.max_generators_per_key)"), False
        return "", False

    def quarantined(self, principal: str) -> str:
        """Why `principal` may not register now ("" when it may)."""
        until, why = self._quarantined.get(principal, (0.0, ""))
        if time.monotonic() < until:
            return f"quarantined for {until - time.monotonic():.0f} s more ({why}); hub.quarantine_s"
        return ""

    def add(self, msg: P.Register, ident: bytes, user: str, transport: str, loaded_version: int,
            on_learner_gpus: bool = False) -> GeneratorInfo:
        gen = GeneratorInfo(msg.generator_id, msg.host, msg.gpus, msg.pid, next(self._index), transport,
                            time.monotonic(), ident=ident, user=user, session=secrets.token_hex(16),
                            version=loaded_version, adapter_slots=msg.adapter_slots, on_learner_gpus=on_learner_gpus)
        self.generators[gen.generator_id] = gen
        self._active = None
        return gen

    def remove(self, generator_id: str) -> GeneratorInfo | None:
        self._active = None
        return self.generators.pop(generator_id, None)

    def drains(self, gen: GeneratorInfo) -> None:
        gen.draining = True
        self._active = None

    def active_principals(self) -> set[str]:
        """The principals of the generators not draining, kept (the same set) until a generator registers, leaves or
        drains: every lease request asks for them (LeaseDesk.share), and walking a thousand generators for each
        took the hub's whole core."""
        if self._active is None:
            self._active = {g.principal for g in self.generators.values() if not g.draining}
        return self._active

    def speaker(self, generator_id: str, ident: bytes, user: str) -> tuple[GeneratorInfo | None, P.Error | None]:
        """The generator a message speaks for, if it came from the connection (and key) that registered it."""
        gen = self.generators.get(generator_id)
        if gen is None:
            return None, P.Error(f"unknown generator id {generator_id!r}: register again", fatal=True)
        if gen.ident != ident or gen.user != user:
            return None, P.Error(f"generator {generator_id!r} from a connection that did not register it")
        gen.last_seen = time.monotonic()
        return gen, None

    def sender(self, group: P.RolloutGroup, user: str) -> tuple[GeneratorInfo | None, str, str]:
        """The generator a rollout comes from, checked by its session and key: (it, "", "") or (None, reason,
        detail)."""
        gen = self.generators.get(group.generator_id)
        where = f"rollout for prompt {(group.epoch, group.prompt_id)}"
        if gen is None:
            return None, "generator", f"{where} from unregistered generator id {group.generator_id!r}"
        if not hmac.compare_digest(gen.session, group.session) or gen.user != user:
            return None, "identity", f"{where} under generator id {group.generator_id!r} without its session or key"
        return gen, "", ""

    def quarantine(self, principal: str, seconds: float, why: str) -> float:
        self._quarantined[principal] = (time.monotonic() + seconds, why)
        return seconds

    def confirmed(self, principals: set[str]) -> bool:
        """A fault confirmed: reported by two principals, or by every one registered (a lone generator)."""
        return len(principals) >= 2 or {g.principal for g in self.generators.values()} <= principals

    def principal_of(self, generator_id: str) -> str:
        gen = self.generators.get(generator_id)
        return gen.principal if gen else generator_id

    def heard(self, generator_id: str, within_s: float) -> bool:
        """Whether the generator is registered and spoke within the last `within_s` seconds (a heartbeat, a lease
        request, ...): a process killed or frozen falls silent."""
        gen = self.generators.get(generator_id)
        return gen is not None and time.monotonic() - gen.last_seen <= within_s

    def silent(self, timeout_s: float) -> list[GeneratorInfo]:
        now = time.monotonic()
        return [g for g in self.generators.values() if now - g.last_seen > timeout_s]

    def uses(self, transport: str) -> bool:
        return any(g.transport == transport for g in self.generators.values())

    def wants(self, transports: set[str]) -> bool:
        """Some generator uses one of `transports`, or none is registered (the next one may)."""
        return not self.generators or any(g.transport in transports for g in self.generators.values())

    def progressed(self, gen: GeneratorInfo) -> None:
        gen.progress_at, gen.stalled = time.monotonic(), False

    def status(self, version: int, leases: dict[str, int]) -> list[P.GeneratorStatus]:
        """One row per generator. Its version is one the hub published (checked where it is reported), so the lag
        is small and fits the wire; a generator ahead of the learner's trained version (announced, not yet
        finished) shows lag 0."""
        now = time.monotonic()
        return [P.GeneratorStatus(g.generator_id, g.host, g.gpus, g.version,
                                  max(0, version - g.version) if g.version >= 0 else -1, g.tokens_per_s,
                                  leases.get(g.generator_id, 0), g.groups, g.tokens, round(now - g.last_seen, 2),
                                  g.transport, g.draining, g.adapter_slots)
                for g in self.generators.values()]


def registration_problem(msg: P.Register) -> str:
    if not GENERATOR_ID.fullmatch(msg.generator_id):
        return f"generator_id {msg.generator_id[:40]!r}: 1-128 characters of letters, digits and ._:-"
    if not msg.host.isprintable() or not msg.boot_id.isprintable():
        return "host and boot_id must be printable"
    if not re.fullmatch(r"[0-9,]*", msg.gpus):
        return f"gpus {msg.gpus[:40]!r}: GPU indices separated by commas"
    if not 1 <= msg.tensor_parallel <= 64 or msg.pid < 0 or not 0 <= msg.adapter_slots <= 1024:
        return f"tensor_parallel {msg.tensor_parallel} (1-64), pid {msg.pid} or adapter_slots {msg.adapter_slots}"
    return ""
