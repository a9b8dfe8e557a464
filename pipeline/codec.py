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
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

# 3: typed replies, sampling and announcements (WeightsReady.file), RunComplete, one route; 4: the nccl join
# handshake (each worker announces itself on the group's store before the group is built), Heartbeat.generated;
# 5: the run's spec (SpecRequest -> RunSpec) before registering, which a Register must show (spec_digest, fingerprints);
# 6: an agent's trajectories (Sample.prompt_ids, trajectory, turns); 7: model fingerprints of format 2
# (pipeline/fingerprint.py), which a peer of an earlier release computes otherwise (its files would be refused as other
# files), and the content digests of the code and files the run's config names (RunSpec.contents, Register.contents:
# pipeline/pinning.py), which a Register must show; 8: the run's spec carries sampling.seed (a per-request seed),
# which a generator of an earlier release would not know
SCHEMA_VERSION = 8


@dataclass(frozen=True)
class Limits:
    """What decoding one message may cost."""

    bytes: int = 2**20
    items: int = 4096  # elements of one array or map
    containers: int = 256  # arrays and maps in the whole message (each costs about 1 us to build)
    depth: int = 8  # nesting of arrays and maps


FROM_PEER = Limits()  # the hub decoding a generator's or operator's control message (rollouts: hub/hub.py)
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
    names = _field_names(type(msg))
    assert names is not None  # a Message is a dataclass
    for name in names:
        body[name] = _to_wire(getattr(msg, name))
    return msgpack.packb(body, use_bin_type=True)


def _to_wire(value: Any) -> Any:
    names = _field_names(type(value))
    if names is not None:
        return {name: _to_wire(getattr(value, name)) for name in names}
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


_NAMES: dict[type, tuple[str, ...] | None] = {}  # a dict, not functools.cache: this runs for every value encoded,
# and the cache (a key tuple a call) took about 60 ns more a call


def _field_names(cls: type) -> tuple[str, ...] | None:
    """A dataclass's field names (None for any other type), looked up once per type."""
    if cls not in _NAMES:
        _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None
    return _NAMES[cls]


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
    # annotated `type`: mypy takes a type[Message] for unhashable (the functools.cache calls below)
    cls: type | None = _REGISTRY.get(kind) if isinstance(kind, str) else None
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
    if _free_form(cls) or not body.keys() <= _names(cls):  # else the typed check goes only as deep as the type
        _check_depth(body, limits.depth)
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
    return body


@functools.cache
def _names(cls: type) -> frozenset[str]:
    names = _field_names(cls)
    assert names is not None  # decode's class is a Message
    return frozenset(names)


@functools.cache
def _free_form(tp: Any) -> bool:
    """Whether a value of this type may hold arrays and maps of any shape (an Any somewhere in it)."""
    if tp is Any:
        return True
    if dataclasses.is_dataclass(tp):
        return any(_free_form(h) for h in typing.get_type_hints(tp).values())
    return any(_free_form(a) for a in typing.get_args(tp))


def _check_depth(body: Any, limit: int) -> None:
    """Nesting of arrays and maps at most `limit`, level by level (iterative: the containers are already counted)."""
    level, depth = [body], 1
    while level:
        deeper: list[dict | list] = []
        for value in level:
            if type(value) is dict:
                value = value.values()
            elif type(value) is not list:
                continue
            deeper.extend(c for c in value if type(c) is dict or type(c) is list)
        if deeper and depth >= limit:
            raise ProtocolError(f"message nests arrays and maps deeper than {limit} levels")
        level, depth = deeper, depth + 1


def _from_wire(cls: type, body: Any, where: str) -> Any:
    try:
        return _checker(cls)(body)
    except _Bad as e:
        raise ProtocolError(f"{where}{e.path}: {e.message}") from None


class _Bad(Exception):
    """A value that is not what its field says; `path` grows as it unwinds (".samples[0].tokens")."""

    def __init__(self, path: str, message: str):
        self.path, self.message = path, message


@functools.cache
def _checker(tp: Any) -> Callable[[Any], Any]:
    """The check of a field's type, made once per type: a value in, the value (int as float where a float is
    meant) out, or _Bad. Resolving the type hints for every field of every message took half the hub's time
    with a thousand generators (bench/hub_ceiling.py)."""
    if tp is Any:
        return lambda v: v
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # `X | None`
        optional = type(None) in typing.get_args(tp)
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        check = _checker(inner)
        return lambda v: None if v is None and optional else check(v)
    origin = typing.get_origin(tp)
    if origin is dict:
        return _dict_checker(*map(_checker, typing.get_args(tp)))
    if origin is list:
        return _list_checker(_checker(typing.get_args(tp)[0]))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_checker(tp)
    if tp is float:
        def check_float(v):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            raise _Bad("", f"expected float, got {type(v).__name__}")
        return check_float
    if tp is int:
        def check_int(v):
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            raise _Bad("", f"expected int, got {type(v).__name__}")
        return check_int

    def check_instance(v):
        if isinstance(v, tp):
            return v
        raise _Bad("", f"expected {tp.__name__}, got {type(v).__name__}")
    return check_instance


def _dict_checker(key, value) -> Callable[[Any], Any]:
    def check(v):
        if not isinstance(v, dict):
            raise _Bad("", f"expected a map, got {type(v).__name__}")
        out = {}
        for k, x in v.items():
            try:
                k = key(k)
            except _Bad as e:
                raise _Bad(f" key{e.path}", e.message) from None
            try:
                out[k] = value(x)
            except _Bad as e:
                raise _Bad(f"[{k!r}]{e.path}", e.message) from None
        return out
    return check


def _list_checker(item) -> Callable[[Any], Any]:
    def check(v):
        if not isinstance(v, list):
            raise _Bad("", f"expected a list, got {type(v).__name__}")
        try:
            return [item(x) for x in v]
        except _Bad as e:
            i = next(i for i, x in enumerate(v) if _fails(item, x))
            raise _Bad(f"[{i}]{e.path}", e.message) from None
    return check


def _fails(check, value) -> bool:
    try:
        check(value)
    except _Bad:
        return True
    return False


def _dataclass_checker(cls: type) -> Callable[[Any], Any]:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _checker(hints[f.name]), f.metadata.get("max_len", DEFAULT_MAX_STR) if hints[f.name] is str
               else None, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
              for f in dataclasses.fields(cls)]

    def check(body):
        if not isinstance(body, dict):
            raise _Bad("", f"expected a map, got {type(body).__name__}")
        kwargs = {}
        for name, field_check, max_len, required in fields:
            if name in body:
                try:
                    value = field_check(body[name])
                except _Bad as e:
                    raise _Bad(f".{name}{e.path}", e.message) from None
                if max_len is not None and len(value) > max_len:
                    raise _Bad(f".{name}", f"{len(value)} characters, at most {max_len}")
                kwargs[name] = value
            elif required:
                raise _Bad(f".{name}", "missing")
        # unknown fields come from a newer peer that appended them: ignored
        return cls(**kwargs)
    return check


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
