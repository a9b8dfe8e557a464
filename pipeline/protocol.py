"""Wire messages between hub and generators, and their MessagePack codec.

Every message is a small dataclass registered under a tag. On the wire it is one msgpack map:
`{"v": SCHEMA_VERSION, "k": tag, "r": request id, <fields>}`. Bulk arrays (token ids, log-probs) are
raw little-endian bytes (msgpack `bin`): int32 token ids, float32 log-probs. Within a schema version
fields are only ever appended, with defaults, so an older peer's message still decodes. `decode`
validates the schema version, the tag, every field's type and length, and what the message costs to
decode: its bytes, the number and length of its containers, their nesting depth (`Limits`; a peer's
message gets `FROM_PEER`, a few MB of nested empty maps would otherwise cost hundreds of MB). It raises
`ProtocolError` naming the message and field. No pickle anywhere. What a message *says* (token ids in the
vocabulary, finite numbers, versions, whose lease) is checked by the hub (learner/validation.py).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

SCHEMA_VERSION = 2  # 2: sessions, prompt ids in leases, GroupFailed.kind, bounded strings


@dataclass(frozen=True)
class Limits:
    """What decoding one message may cost."""

    bytes: int = 2**20
    items: int = 4096  # elements of one array or map
    containers: int = 256  # arrays and maps in the whole message (each costs about 1 us to build)
    depth: int = 8  # nesting of arrays and maps


FROM_PEER = Limits()  # the hub decoding a generator's or operator's control message (rollouts: learner/hub.py)
FROM_HUB = Limits(bytes=2**31 - 1, items=2**20, containers=2**22, depth=32)  # manifests, dataset columns
MAX_CONTROL_BYTES = FROM_PEER.bytes


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation."""


class PeerLost(ConnectionError):
    """The other side stopped answering (no reply within the handshake timeout or heartbeats missed)."""


_REGISTRY: dict[str, type[Message]] = {}


def text(max_len: int, default: Any = dataclasses.MISSING) -> Any:
    """A string field of at most `max_len` characters (others: 1024); without a default it is required."""
    return field(default=default, metadata={"max_len": max_len})


DEFAULT_MAX_STR = 1024


@dataclass
class Message:
    tag: ClassVar[str] = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.tag:
            _REGISTRY[cls.tag] = cls


# ---- nested structs (no tag of their own) -------------------------------------------------------


@dataclass
class PromptItem:
    prompt_id: int
    epoch: int
    prompt: str = text(2**24)
    columns: dict = field(default_factory=dict)
    prompt_ids: bytes = b""  # int32: the prompt as the learner tokenised it; the generator generates from these


@dataclass
class Sample:
    token_ids: bytes  # int32 little-endian
    logprobs: bytes  # float32 little-endian, one per token: behaviour log-probs from vLLM
    reward: float
    rewards: list[float] = field(default_factory=list)  # one per reward function, unweighted
    finish_reason: str = text(32, "")
    first_version: int = 0  # weights version that produced the first token
    last_version: int = 0  # weights version that produced the last token
    gen_ms: float = 0.0


# ---- control channel: generator -> hub ----------------------------------------------------------


GENERATOR_ID = 128  # characters of a generator id


@dataclass
class Register(Message):
    tag: ClassVar[str] = "register"
    generator_id: str = text(GENERATOR_ID)
    host: str = text(255, "")
    boot_id: str = text(64, "")
    gpus: str = text(128, "")
    pid: int = 0
    loaded_version: int = -1  # >= 0 when reconnecting with an engine that already holds weights
    tensor_parallel: int = 1  # workers of this generator (ranks of its nccl process group, besides the learner)
    session: str = text(64, "")  # re-registering under the same id: the session its last Welcome gave it
    loaded_run: str = text(256, "")  # the run id of the weights its engine holds ("": the model from disk)


@dataclass
class Heartbeat(Message):
    tag: ClassVar[str] = "heartbeat"
    generator_id: str = text(GENERATOR_ID)
    version: int = 0
    tokens_per_s: float = 0.0
    inflight_groups: int = 0
    lease_ids: list[int] = field(default_factory=list)  # every lease it holds (received, not yet finished)
    draining: bool = False  # finishing its groups before it leaves: it takes no more broadcasts
    pushed: int = 0  # rollouts sent in this session: until the hub has them all, an unlisted lease may be in flight


@dataclass
class LeaseRequest(Message):
    tag: ClassVar[str] = "lease_request"
    generator_id: str = text(GENERATOR_ID)
    max_groups: int = 1


@dataclass
class WeightsApplied(Message):
    tag: ClassVar[str] = "weights_applied"
    generator_id: str = text(GENERATOR_ID)
    version: int
    load_ms: float = 0.0
    via: str = text(16, "")  # the transport that delivered it


@dataclass
class GroupFailed(Message):
    """A leased prompt's group could not be generated; `kind` says whose fault: "engine" (lease it again),
    "prompt" (vLLM refused the prompt itself), "reward" (a reward function raised: `reason` holds the function
    and its traceback; an error of the run, not of the prompt)."""

    tag: ClassVar[str] = "group_failed"
    generator_id: str = text(GENERATOR_ID)
    lease_id: int
    epoch: int
    prompt_id: int
    reason: str = text(16384, "")
    kind: str = text(16, "engine")


@dataclass
class WeightsFetch(Message):
    tag: ClassVar[str] = "weights_fetch"
    version: int
    offset: int
    length: int
    generator_id: str = text(GENERATOR_ID, "")  # only registered generators are served


@dataclass
class Leave(Message):
    tag: ClassVar[str] = "leave"
    generator_id: str = text(GENERATOR_ID)
    returned_leases: list[int] = field(default_factory=list)
    reason: str = text(16384, "")  # why it leaves when it is not asked to (its engine died: the engine's error)


@dataclass
class StatusRequest(Message):
    tag: ClassVar[str] = "status_request"


@dataclass
class SetRequest(Message):
    tag: ClassVar[str] = "set_request"
    key: str = text(128)
    value: Any = None


# ---- control channel: hub -> generator ----------------------------------------------------------


@dataclass
class Welcome(Message):
    tag: ClassVar[str] = "welcome"
    run_id: str
    generator_id: str
    version: int
    rollouts_endpoint: str
    weights_endpoint: str
    transport: str
    heartbeat_s: float
    sampling: dict = field(default_factory=dict)
    group_size: int = 2
    index: int = 0  # registration order, for per-generator seeds
    latest: dict = field(default_factory=dict)  # WeightsReady of the current version, as a map
    collective: dict = field(default_factory=dict)  # nccl transport: port, world_size, backend, timeout_s
    session: str = text(64, "")  # a secret of this registration: its rollouts carry it, a re-registration shows it


@dataclass
class Lease(Message):
    tag: ClassVar[str] = "lease"
    lease_id: int
    min_version: int
    groups: list[PromptItem]
    sampling: dict = field(default_factory=dict)


@dataclass
class Wait(Message):
    tag: ClassVar[str] = "wait"
    reason: str = text(4096)
    retry_s: float = 0.05
    version: int = -1  # the learner's version ("run complete": generators apply it before leaving)


@dataclass
class WeightsChunk(Message):
    tag: ClassVar[str] = "weights_chunk"
    version: int
    offset: int
    data: bytes
    total: int


@dataclass
class Ack(Message):
    tag: ClassVar[str] = "ack"
    info: dict = field(default_factory=dict)


@dataclass
class Error(Message):
    tag: ClassVar[str] = "error"
    message: str = text(65536)
    fatal: bool = False  # the peer must re-register (e.g. unknown generator id after a learner restart)
    stop: bool = False  # the peer must leave and exit: the run failed, or it is refused (the message says why)


# ---- rollouts and weight announcements ----------------------------------------------------------


@dataclass
class RolloutGroup(Message):
    tag: ClassVar[str] = "rollout_group"
    lease_id: int
    generator_id: str = text(GENERATOR_ID)
    prompt_id: int
    epoch: int
    prompt_ids: bytes  # int32 little-endian
    samples: list[Sample]
    temperature: float = 1.0  # sampling temperature the behaviour log-probs were computed at
    session: str = text(64, "")  # the session of the generator's registration (Welcome.session)


@dataclass
class WeightsReady(Message):
    tag: ClassVar[str] = "weights_ready"
    version: int
    size: int
    checksum: int  # crc32 of the safetensors blob
    shm_path: str = text(4096, "")  # set when the shm transport wrote the blob to /dev/shm
    published_at: float = 0.0  # learner's time.time() at the end of the optimizer step
    collective: bool = False  # nccl transport: the learner broadcasts the tensors now, in manifest order
    manifest: list = field(default_factory=list)  # [[name, dtype, shape], ...] when collective


# ---- codec ---------------------------------------------------------------------------------------


def encode(msg: Message, rid: int = 0) -> bytes:
    body = {"v": SCHEMA_VERSION, "k": msg.tag, "r": rid}
    for f in dataclasses.fields(msg):
        body[f.name] = _to_wire(getattr(msg, f.name))
    return msgpack.packb(body, use_bin_type=True)


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


def as_dict(msg: Message) -> dict:
    return _to_wire(msg)


def from_dict(cls: type, body: dict) -> Message:
    return _from_wire(cls, body, cls.__name__)


def decode(data, limit: int | None = None, limits: Limits = FROM_PEER) -> tuple[Message, int]:
    """Decode one message (bytes or a buffer); returns (message, request id). `limit` overrides the byte limit
    of `limits`. Raises ProtocolError with a clear reason."""
    nbytes = limits.bytes if limit is None else limit
    if len(data) > nbytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {nbytes} bytes")
    body = _unpack(data, nbytes, limits)
    if not isinstance(body, dict):
        raise ProtocolError(f"expected a message map, got {type(body).__name__}")
    kind = body.pop("k", None)
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    version = body.pop("v", None)
    if version != SCHEMA_VERSION:
        raise ProtocolError(f"{cls.__name__}: schema version {version!r}, this side speaks {SCHEMA_VERSION}")
    rid = body.pop("r", 0)
    if not isinstance(rid, int):
        raise ProtocolError(f"{cls.__name__}.r: request id must be an int, got {type(rid).__name__}")
    return _from_wire(cls, body, cls.__name__), rid


class _Budget:
    """Counts the arrays and maps msgpack builds (its hooks run for each one) and stops past the limit."""

    def __init__(self, limit: int):
        self.left = limit

    def list(self, value: list) -> list:
        return self._take(value)

    def map(self, value: dict) -> dict:
        return self._take(value)

    def _take(self, value):
        self.left -= 1
        if self.left < 0:
            raise ValueError("too many arrays and maps")
        return value


def _unpack(data, nbytes: int, limits: Limits) -> Any:
    budget = _Budget(limits.containers)
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=nbytes, max_str_len=nbytes,
                               max_array_len=limits.items, max_map_len=limits.items, max_ext_len=0,
                               list_hook=budget.list, object_hook=budget.map)
    except Exception as e:  # msgpack raises several types for truncated, random or too costly input
        raise ProtocolError(f"not a valid MessagePack message within the limits ({type(e).__name__}: {e})") from None
    _check_depth(body, limits.depth)
    return body


def _check_depth(body: Any, limit: int) -> None:
    """Nesting of arrays and maps at most `limit` (iterative: the containers are already counted)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            raise ProtocolError(f"message nests arrays and maps deeper than {limit} levels")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _from_wire(cls: type, body: Any, where: str) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(body).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            kwargs[f.name] = _check(hints[f.name], body[f.name], f"{where}.{f.name}")
            if hints[f.name] is str and len(kwargs[f.name]) > f.metadata.get("max_len", DEFAULT_MAX_STR):
                raise ProtocolError(f"{where}.{f.name}: {len(kwargs[f.name])} characters, at most "
                                    f"{f.metadata.get('max_len', DEFAULT_MAX_STR)}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{where}.{f.name}: missing")
    # unknown fields come from a newer peer that appended them: ignored
    return cls(**kwargs)


_HINTS: dict[type, dict] = {}


def _hints(cls: type) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _check(tp: Any, value: Any, where: str) -> Any:
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _from_wire(tp, value, where)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")


# ---- array helpers --------------------------------------------------------------------------------


def pack_ints(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def pack_floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_ints(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4")


def unpack_floats(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4")


def check_rollout(group: RolloutGroup, group_size: int) -> None:
    """Validate array sizes of a decoded RolloutGroup (types are already checked by `decode`)."""
    where = f"RolloutGroup(prompt_id={group.prompt_id})"
    if len(group.prompt_ids) % 4 or not group.prompt_ids:
        raise ProtocolError(f"{where}.prompt_ids: {len(group.prompt_ids)} bytes is not a non-empty int32 array")
    if len(group.samples) != group_size:
        raise ProtocolError(f"{where}.samples: {len(group.samples)} samples, the run's group size is {group_size}")
    for i, s in enumerate(group.samples):
        if len(s.token_ids) % 4 or len(s.token_ids) != len(s.logprobs):
            raise ProtocolError(
                f"{where}.samples[{i}]: token_ids ({len(s.token_ids)} bytes) and logprobs ({len(s.logprobs)} bytes) "
                "must be int32/float32 arrays of one length"
            )
        if s.first_version > s.last_version:
            raise ProtocolError(
                f"{where}.samples[{i}]: first_version {s.first_version} > last_version {s.last_version}")
