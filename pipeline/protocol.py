"""Wire messages between hub and generators, and their MessagePack codec.

Every message is a small dataclass registered under a tag. On the wire it is one msgpack map:
`{"v": SCHEMA_VERSION, "k": tag, "r": request id, <fields>}`. Bulk arrays (token ids, log-probs) are
raw little-endian bytes (msgpack `bin`): int32 token ids, float32 log-probs. Fields are only ever
appended, with defaults, so an older peer's message still decodes. `decode` validates the schema
version, the tag, every field's type and the message size, and raises `ProtocolError` naming the
message and field. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

SCHEMA_VERSION = 1
MAX_CONTROL_BYTES = 16 * 2**20  # control requests are small; weight chunks flow the other way


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation."""


class PeerLost(ConnectionError):
    """The other side stopped answering (no reply within the handshake timeout or heartbeats missed)."""


_REGISTRY: dict[str, type[Message]] = {}


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
    prompt: str
    columns: dict = field(default_factory=dict)


@dataclass
class Sample:
    token_ids: bytes  # int32 little-endian
    logprobs: bytes  # float32 little-endian, one per token: behaviour log-probs from vLLM
    reward: float
    rewards: list[float] = field(default_factory=list)  # one per reward function, unweighted
    finish_reason: str = ""
    first_version: int = 0  # weights version that produced the first token
    last_version: int = 0  # weights version that produced the last token
    gen_ms: float = 0.0


# ---- control channel: generator -> hub ----------------------------------------------------------


@dataclass
class Register(Message):
    tag: ClassVar[str] = "register"
    generator_id: str
    host: str = ""
    boot_id: str = ""
    gpus: str = ""
    pid: int = 0
    loaded_version: int = -1  # >= 0 when reconnecting with an engine that already holds weights
    tensor_parallel: int = 1  # workers of this generator (ranks of its nccl process group, besides the learner)


@dataclass
class Heartbeat(Message):
    tag: ClassVar[str] = "heartbeat"
    generator_id: str
    version: int = 0
    tokens_per_s: float = 0.0
    inflight_groups: int = 0
    lease_ids: list[int] = field(default_factory=list)
    draining: bool = False  # finishing its groups before it leaves: it takes no more broadcasts


@dataclass
class LeaseRequest(Message):
    tag: ClassVar[str] = "lease_request"
    generator_id: str
    max_groups: int = 1


@dataclass
class WeightsApplied(Message):
    tag: ClassVar[str] = "weights_applied"
    generator_id: str
    version: int
    load_ms: float = 0.0
    via: str = ""  # the transport that delivered it


@dataclass
class GroupFailed(Message):
    """A leased prompt's group could not be generated. `retry`: the failure was the engine's, lease the
    prompt again; otherwise vLLM rejected the prompt itself (empty, longer than max_model_len)."""

    tag: ClassVar[str] = "group_failed"
    generator_id: str
    lease_id: int
    epoch: int
    prompt_id: int
    reason: str = ""
    retry: bool = True


@dataclass
class WeightsFetch(Message):
    tag: ClassVar[str] = "weights_fetch"
    version: int
    offset: int
    length: int


@dataclass
class Leave(Message):
    tag: ClassVar[str] = "leave"
    generator_id: str
    returned_leases: list[int] = field(default_factory=list)


@dataclass
class StatusRequest(Message):
    tag: ClassVar[str] = "status_request"


@dataclass
class SetRequest(Message):
    tag: ClassVar[str] = "set_request"
    key: str
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
    reason: str
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
    message: str
    fatal: bool = False  # the peer must re-register (e.g. unknown generator id after a learner restart)


# ---- rollouts and weight announcements ----------------------------------------------------------


@dataclass
class RolloutGroup(Message):
    tag: ClassVar[str] = "rollout_group"
    lease_id: int
    generator_id: str
    prompt_id: int
    epoch: int
    prompt_ids: bytes  # int32 little-endian
    samples: list[Sample]
    temperature: float = 1.0  # sampling temperature the behaviour log-probs were computed at


@dataclass
class WeightsReady(Message):
    tag: ClassVar[str] = "weights_ready"
    version: int
    size: int
    checksum: int  # crc32 of the safetensors blob
    shm_path: str = ""  # set when the shm transport wrote the blob to /dev/shm
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


def decode(data: bytes, limit: int = MAX_CONTROL_BYTES) -> tuple[Message, int]:
    """Decode one message; returns (message, request id). Raises ProtocolError with a clear reason."""
    if len(data) > limit:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {limit} bytes")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=limit, max_str_len=limit)
    except Exception as e:  # msgpack raises several types for truncated or random input
        raise ProtocolError(f"not a valid MessagePack message ({type(e).__name__}: {e})") from None
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


def _from_wire(cls: type, body: Any, where: str) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(body).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            kwargs[f.name] = _check(hints[f.name], body[f.name], f"{where}.{f.name}")
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
