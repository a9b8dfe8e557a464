"""The MessagePack codec of the wire messages, and what decoding one may cost.

A message is a dataclass registered under a tag (`Message` subclasses). On the wire it is one msgpack map:
`{"v": SCHEMA_VERSION, "k": tag, "r": request id, <fields>}`; nested structs are maps, bulk arrays raw
little-endian bytes (`pack_ints`, `pack_floats`). `decode` checks the schema version, the tag, every field's
type and length (strings: `text(max_len)`), and what the message costs to decode: its bytes, the number and
length of its containers and their nesting depth (`Limits`: a peer's message gets `FROM_PEER`; a few MB of
nested empty maps would otherwise cost hundreds of MB). It raises `ProtocolError` naming the message and
field. No pickle anywhere. The messages themselves are in pipeline/protocol.py.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

# 3: typed replies, sampling and announcements (WeightsReady.file), RunComplete, one route; 4: the nccl join
# handshake (each worker announces itself on the group's store before the group is built), Heartbeat.generated
SCHEMA_VERSION = 4


@dataclass(frozen=True)
class Limits:
    """What decoding one message may cost."""

    bytes: int = 2**20
    items: int = 4096  # elements of one array or map
    containers: int = 256  # arrays and maps in the whole message (each costs about 1 us to build)
    depth: int = 8  # nesting of arrays and maps


FROM_PEER = Limits()  # the hub decoding a generator's or operator's control message (rollouts: learner/hub.py)
FROM_HUB = Limits(bytes=2**31 - 1, items=2**20, containers=2**22, depth=32)  # manifests, dataset columns


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation."""


class SchemaMismatch(ProtocolError):
    """The peer speaks another schema version: another release of this project, which no retry will fix."""

    def __init__(self, message: str, rid: int = 0):
        super().__init__(message)
        self.rid = rid


_REGISTRY: dict[str, type[Message]] = {}
DEFAULT_MAX_STR = 1024


def text(max_len: int, default: Any = dataclasses.MISSING) -> Any:
    """A string field of at most `max_len` characters (others: DEFAULT_MAX_STR); without a default it is required."""
    return field(default=default, metadata={"max_len": max_len})


@dataclass
class Message:
    tag: ClassVar[str] = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.tag:
            _REGISTRY[cls.tag] = cls


# ---- encoding and decoding ---------------------------------------------------------------------------------------


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
    rid = body.pop("r", 0)
    if version != SCHEMA_VERSION:
        raise SchemaMismatch(f"{cls.__name__}: schema version {version!r}, this side speaks {SCHEMA_VERSION} (run the "
                             "same release of the project on the learner and the generators)",
                             rid if isinstance(rid, int) else 0)
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
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # `X | None`
        if value is None and type(None) in typing.get_args(tp):
            return None
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = typing.get_args(tp)
        return {_check(kt, k, f"{where} key"): _check(vt, v, f"{where}[{k!r}]") for k, v in value.items()}
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


def pack_mask(values) -> bytes:
    return np.asarray(values, dtype=np.uint8).tobytes()


def unpack_mask(data: bytes, n: int) -> np.ndarray:
    """A sample's loss mask: one uint8 per token, all ones when empty."""
    return np.frombuffer(data, dtype=np.uint8) if data else np.ones(n, dtype=np.uint8)
