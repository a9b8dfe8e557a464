"""One run, one truth: which config fields the learner decides for every generator, and which may differ on --resume.

A generator asks the hub for the run's spec before it builds its engine (`SpecRequest` -> `RunSpec`) and adopts it
(`adopt`): the values of `SERVED`, what a generator serves and scores (the model and its tokenizer, dtype,
quantization, LoRA, sampling, rewards, the rollout function, max_model_len, k). Its own file and flags keep only where
and how it runs (GPUs, engine memory knobs, tensor parallelism, keys), so `pipeline generator --learner ADDR` needs no
model config. What its own config sets explicitly (`explicit_keys`) under SERVED it claims (`claims`). The hub refuses
a claim under `REFUSED` that differs from the run's (`conflict`), naming the field: another model, quantization, LoRA,
reward, rollout function or max_model_len would sample or score another policy than the run's. Any other claim that
differs (sampling, the group size, ...: the learner's anyway, they travel with every lease) the generator names in a
warning and takes the run's (`overridden`). model.path and model.tokenizer are claimed by fingerprint instead
(pipeline/fingerprint.py): a generator may find the same files at another path on its host. The digest covers the
names of the rewards, rollout, agent, environment and chat template; what they name is compared by content
(pipeline/pinning.py).
Registering, it shows the digest of what it adopted (`digest`, computed the same way on both sides; the run-time knobs
are left out, they travel with leases and heartbeats).

A resumed run (`--resume RUN_DIR`) continues the run it resumes: its config may differ from RUN_DIR/config.yaml only
in `RESUMABLE` fields and the run-time knobs (`resume_conflict`).

Which fields are which is declared beside each one in pipeline/config.py (`knob`: generator own, served or refused;
by_fingerprint; resumable); SERVED, REFUSED, BY_FINGERPRINT and RESUMABLE are derived from it (`field_facts`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from collections.abc import Callable
from typing import Any

from pipeline.config import Config, config_from_dict, parse_override
from pipeline.runtime_knobs import runtime_keys

MISSING = object()


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def field_facts(cls: type = Config, prefix: str = "", held: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """{dotted key: what its field declares (pipeline/config.py, `knob`)} of every field under `cls` that holds a value,
    a list's or an optional section's under its own key (`rewards.fn`, `model.lora.r`). A fact declared on a field
    that holds a section holds for every field in it, whatever they declare."""
    hints = typing.get_type_hints(cls)
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(cls):
        facts, tp = {**f.metadata, **(held or {})}, hints[f.name]
        sections = [t for t in (tp, *typing.get_args(tp)) if isinstance(t, type) and dataclasses.is_dataclass(t)]
        if sections:  # a section (model), a list of them (rewards) or an optional one (model.lora)
            out |= field_facts(sections[0], f"{prefix}{f.name}.", facts)
        else:
            out[prefix + f.name] = facts
    return out


def _table(has: Callable[[dict[str, Any]], Any]) -> tuple[str, ...]:
    """The keys whose facts satisfy `has`, in the config's order; a section's name stands for its fields where all of
    them do (a prefix covers its subtree)."""
    whole: dict[str, bool] = {}  # {prefix: whether every field under it satisfies `has`}
    for key, declared in FACTS.items():
        for prefix in _prefixes(key):
            whole[prefix] = whole.get(prefix, True) and bool(has(declared))
    return tuple(dict.fromkeys(next(p for p in _prefixes(key) if whole[p]) for key in FACTS if whole[key]))


def _prefixes(key: str) -> list[str]:
    """`model.lora.r` -> model, model.lora, model.lora.r."""
    parts = key.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


FACTS = field_facts()  # every field's, walked once for the tables below
# what a generator serves and scores: the learner's, adopted by every generator (a prefix covers its subtree)
SERVED = _table(lambda facts: facts.get("generator") in ("served", "refused"))
REFUSED = _table(lambda facts: facts.get("generator") == "refused")  # a generator claiming otherwise is refused
BY_FINGERPRINT = _table(lambda facts: facts.get("by_fingerprint"))  # claimed by the files' fingerprints, not the path
# how a service runs, how long and how often it saves: may differ on --resume (so may the run-time knobs)
RESUMABLE = _table(lambda facts: facts.get("resumable"))


def _plain(value: Any) -> Any:
    """A config value as plain data (dataclasses as dicts, tuples as lists), as msgpack carries it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def value_at(data: Any, key: str) -> Any:
    """The value at dotted `key` of a config (object or dict), MISSING where a part of the path is absent or None."""
    for part in key.split("."):
        if data is None or data is MISSING:  # a section left out (model.lora: None) has no fields
            return MISSING
        if dataclasses.is_dataclass(data):  # its fields only (a peer names the key)
            data = getattr(data, part) if part in {f.name for f in dataclasses.fields(data)} else MISSING
        else:
            data = data.get(part, MISSING) if isinstance(data, dict) else MISSING
    return data if data is MISSING else _plain(data)


def spec_of(cfg: Config) -> dict[str, Any]:
    """The run's SERVED values, {prefix: value}: a RunSpec's config."""
    return {key: value_at(cfg, key) for key in SERVED}


def digest(cfg: Config) -> str:
    """What a generator serves, in one string: the SERVED values but the run-time knobs and the paths (the
    fingerprints stand for those), hashed the same way on both sides."""
    runtime = set(runtime_keys())
    fixed = {k: v for k, v in _leaves(spec_of(cfg)).items() if k not in runtime and not _under(k, BY_FINGERPRINT)}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:32]


def adopt(own: Config, spec: dict[str, Any], explicit: set[str] | frozenset = frozenset()) -> Config:
    """`own` (a generator's config) with the run's SERVED values; model.path and model.tokenizer stay its own where it
    set them explicitly (where the files lie on its host). Validated as at load."""
    data = own.to_dict()
    for key in SERVED:
        if key not in spec:
            raise ValueError(f"the run's spec lacks {key}")
        _set(data, key, spec[key])
    for key in BY_FINGERPRINT:
        if key in explicit:
            _set(data, key, value_at(own, key))
    return config_from_dict(data)


def _set(data: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    data[last] = value


def explicit_keys(file_data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> set[str]:
    """The dotted keys a config file (its YAML mapping) and `--set` overrides set: every leaf, and a mapping left
    empty (`model.lora: {}`, LoRA with its defaults) as one."""
    keys = set(_leaves(file_data or {}))
    for item in overrides:
        keys |= set(_leaves(dict([parse_override(item)])))
    return keys


def claims(cfg: Config, explicit: set[str] | frozenset) -> dict[str, Any]:
    """What a generator's own config says explicitly of what it serves: {dotted key: its value}."""
    runtime = set(runtime_keys())
    values = {key: value_at(cfg, key) for key in sorted(explicit)
              if _under(key, SERVED) and key not in runtime and not _under(key, BY_FINGERPRINT)}
    return {k: v for k, v in values.items() if v is not MISSING}  # a field under a section --set to null


def conflict(claimed: dict[str, Any], run: Config) -> str:
    """Why a generator's claims do not fit the run ("" when they do): the first field under REFUSED whose value
    differs, named."""
    runtime = set(runtime_keys())
    for key, value in claimed.items():
        if not isinstance(key, str) or not _under(key, SERVED) or key in runtime or _under(key, BY_FINGERPRINT):
            return f"{str(key)[:80]!r} is not a field a generator may state (what it serves: {', '.join(SERVED)})"
        if _under(key, REFUSED) and value_at(run, key) != value:
            return (f"{key} is {_show(value)} in the generator's config but {_describe(run, key)} in the run's: a "
                    "generator serves the learner's config; drop the field from the generator's config or --set (or "
                    "give the run's value), or start it with --learner alone")
    return ""


def overridden(claimed: dict[str, Any], run: Config) -> list[str]:
    """The claims outside REFUSED that the run's values replace: `key: ours -> the run's`."""
    return [f"{key}: {_show(value)} -> {_describe(run, key)}" for key, value in claimed.items()
            if not _under(key, REFUSED) and value_at(run, key) != value]


def fingerprint_conflict(theirs: dict[str, str], ours: dict[str, str]) -> str:
    """Why a generator's model files are not the run's ("" when they are), naming the field."""
    for key in sorted(ours.keys() | theirs.keys()):
        if theirs.get(key) != ours.get(key):
            return (f"{key}: the files this generator would serve have fingerprint {theirs.get(key, 'none')!s:.16}, "
                    f"the run's {ours.get(key, 'none')!s:.16}: another model or tokenizer than the learner's")
    return ""


def resume_conflict(cfg: Config, saved: Config, where: str) -> str:
    """Why `cfg` cannot resume the run whose config is `saved` (read from `where`), "" when it can: the first field
    outside RESUMABLE and the run-time knobs that differs."""
    for key in _differing(cfg, saved):
        if not _under(key, RESUMABLE):
            key = _shared_parent(key, cfg, saved)
            return (f"{key} is {_describe(cfg, key)} here but {_describe(saved, key)} in {where}: a "
                    "resume continues the run it resumes. Resume with the run's own config (`--resume RUN_DIR` "
                    "without -c; --set only for what may differ), or start another run")
    return ""


def resumed_changes(cfg: Config, saved: Config) -> list[str]:
    """What a resume changes that it may (RESUMABLE, the run-time knobs aside): `key: old -> new`, said at start, so
    that a restart with another file than the run's drops no --set of the first start unseen."""
    new, old = _leaves(_plain(cfg.to_dict())), _leaves(_plain(saved.to_dict()))
    return [f"{k}: {_show(old.get(k, MISSING))} -> {_show(new.get(k, MISSING))}" for k in _differing(cfg, saved)]


def _differing(cfg: Config, saved: Config) -> list[str]:
    """The leaf keys whose values differ between two configs, the run-time knobs aside, sorted."""
    runtime = set(runtime_keys())
    new, old = _leaves(_plain(cfg.to_dict())), _leaves(_plain(saved.to_dict()))
    return sorted(k for k in new.keys() | old.keys() if k not in runtime and new.get(k, MISSING) != old.get(k, MISSING))


def _leaves(data: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf of nested mappings; a mapping left empty is a leaf."""
    out = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(_leaves(v, key))
        else:
            out[key] = v
    return out


def _shared_parent(key: str, *cfgs: Config) -> str:
    """`key`, or its nearest parent that one of `cfgs` leaves out (None): `model.lora`, not `model.lora.r`."""
    parts = key.split(".")
    for n in range(1, len(parts)):
        parent = ".".join(parts[:n])
        if any(value_at(c, parent) is None for c in cfgs):
            return parent
    return key


def _describe(cfg: Config, key: str) -> str:
    """`key`'s value in `cfg`, or which parent of it is left out."""
    value = value_at(cfg, key)
    if value is MISSING:
        parent = _shared_parent(key, cfg)
        return f"absent ({parent} is None)" if parent != key else "absent"
    return _show(value)


def _show(value: Any) -> str:
    return "absent" if value is MISSING else repr(value)[:200]
