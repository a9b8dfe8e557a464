"""The knobs `pipeline set` may change while a run goes on (`knob(runtime=True)` in pipeline/config.py): which they are,
their values now as one step's snapshot, and one change checked and applied."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from pipeline import validate
from pipeline.config import Config
from pipeline.validate import ConfigError


def runtime_field(cfg: Config, key: str) -> tuple[Any, dataclasses.Field]:
    """Return (section object, its field) of a knob `pipeline set` may change, else raise ConfigError; a misspelt
    name gets the "did you mean" a config file's does (pipeline/validate.py, `build`)."""
    parts = key.split(".")
    sections = [f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]
    if parts[0] not in sections:
        raise validate.unknown_field(parts[0], parts[0], sections)
    section = getattr(cfg, parts[0])
    fields = {f.name: f for f in dataclasses.fields(section)}
    if len(parts) != 2 or parts[1] not in fields:
        raise validate.unknown_field(key, parts[-1] if len(parts) > 1 else "", list(fields))
    if not fields[parts[1]].metadata.get("runtime"):
        allowed = ", ".join(runtime_keys())
        raise ConfigError(f"{key}: cannot change while a run goes on (run-time knobs: {allowed})")
    return section, fields[parts[1]]


def runtime_keys() -> list[str]:
    return list(_runtime_keys())


@functools.cache
def _runtime_keys() -> tuple[str, ...]:  # resolving the type hints took a quarter of the hub's time (runtime_values)
    hints = typing.get_type_hints(Config)
    keys = []
    for top in dataclasses.fields(Config):
        tp = hints[top.name]
        if dataclasses.is_dataclass(tp):
            keys += [f"{top.name}.{f.name}" for f in dataclasses.fields(tp) if f.metadata.get("runtime")]
    return tuple(keys)


def runtime_values(cfg: Config) -> dict[str, Any]:
    """The run-time knobs as they are now, {dotted key: value}: one step's snapshot, read once (under the hub's lock
    on rank 0) and used by every rank for the whole step."""
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in runtime_keys()}


def apply_runtime_change(cfg: Config, key: str, value: Any) -> Any:
    """Validate and apply one run-time change in place; returns the coerced value."""
    section, f = runtime_field(cfg, key)
    new = validate.check_value(key, typing.get_type_hints(type(section))[f.name], value)
    validate.check_range(key, new, f.metadata.get("range"))
    setattr(section, f.name, new)
    return new
