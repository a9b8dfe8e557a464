"""Checking config values as they are loaded or changed: each value coerced to its field's annotation (types,
choices, lists, nested sections), each number in its field's range and finite, and the checks that span several
fields (`check_config`); errors name the dotted field."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from pipeline import builtin
from pipeline.transports import TRANSPORTS


class ConfigError(ValueError):
    """A config field is unknown, of the wrong type or out of range; the message names it."""


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric field: lo < v (or <=) and v < hi (or <=); None: unbounded."""

    lo: float | None = None
    hi: float | None = None
    lo_closed: bool = True
    hi_closed: bool = True
    why: str = ""  # the reason for a bound that is not obvious, said in the refusal

    def holds(self, v) -> bool:
        above = self.lo is None or (v >= self.lo if self.lo_closed else v > self.lo)
        below = self.hi is None or (v <= self.hi if self.hi_closed else v < self.hi)
        return above and below

    def __str__(self) -> str:
        if self.hi is None:
            return f"must be {'>=' if self.lo_closed else '>'} {self.lo}"
        why = f" ({self.why})" if self.why else ""
        return f"must be in {'[' if self.lo_closed else '('}{self.lo}, {self.hi}{']' if self.hi_closed else ')'}{why}"


# A field's range is declared beside it (pipeline/config.py, `knob`) and checked at load and on `pipeline set`; every
# float must also be finite. The run-time knobs have upper bounds too: a value past them cannot be meant, and
# `pipeline set` must not wreck a running run.
POSITIVE, NON_NEGATIVE, FRACTION = Range(0, lo_closed=False), Range(0), Range(0, 1, lo_closed=False)
TEMPERATURE = Range(0, 10, lo_closed=False, why="past 10 sampling is close to uniform over the vocabulary")


def check_range(name: str, value: Any, rng: Range | None) -> None:
    """`value` of field `name` finite and within its declared range `rng` (None: any)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: must be a finite number, got {value!r}")
    if rng is not None and not rng.holds(value):
        raise ConfigError(f"{name}: {rng}, got {value!r}")


def check_value(name: str, tp: Any, value: Any) -> Any:
    """Coerce `value` to annotation `tp` or raise ConfigError naming `name`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for arg in args[:-1]:  # the first member that takes the value; the last one's error if none does
            try:
                return check_value(name, arg, value)
            except ConfigError:
                pass
        return check_value(name, args[-1], value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [check_value(f"{name}[{i}]", item_tp, v) for i, v in enumerate(value)]
    if origin is dict:  # a mapping whose names and values its reader checks (data.options: reasoning-gym's config)
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return {str(k): v for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, name)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or isinstance(value, bool) and tp is not bool:
        raise ConfigError(f"{name}: expected {tp.__name__}, got {value!r}")
    return value


def did_you_mean(name: str, names) -> str:
    """" (did you mean X?)" with the one of `names` closest to `name`; "" when none is close."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_field(dotted: str, name: str, names: list[str]) -> ConfigError:
    """The error for a field `name` that is not among `names`, with the closest one ("did you mean")."""
    hint = did_you_mean(name, names) or f" (known: {', '.join(names)})"
    return ConfigError(f"{dotted}: unknown field{hint}")


def build(cls: type, data: Any, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            raise unknown_field(dotted, str(key), names)
        kwargs[key] = check_value(dotted, hints[key], value)
    obj = cls(**kwargs)
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            check_range(f"{prefix}.{f.name}" if prefix else f.name, value, f.metadata.get("range"))
    return obj


def check_config(cfg) -> None:
    """Checks that span several fields (each field's own range is checked where it is built)."""
    if cfg.sampling.max_tokens >= cfg.generator.max_model_len:
        raise ConfigError(f"sampling.max_tokens: {cfg.sampling.max_tokens} leaves no room for a prompt within "
                          f"generator.max_model_len={cfg.generator.max_model_len}")
    if cfg.sampling.top_p != 1.0:
        raise ConfigError(f"sampling.top_p: must be 1.0, got {cfg.sampling.top_p}: vLLM's behaviour log-probs are "
                          "taken after the nucleus is renormalised and the learner's over the whole vocabulary, so "
                          "every importance weight would be off by the nucleus's mass. Lower sampling.temperature "
                          "instead")
    if cfg.hub.heartbeat_timeout_s <= cfg.hub.heartbeat_s:
        raise ConfigError(f"hub.heartbeat_timeout_s: must exceed hub.heartbeat_s ({cfg.hub.heartbeat_s}), got "
                          f"{cfg.hub.heartbeat_timeout_s}")
    if cfg.trainer.overlong_buffer >= cfg.sampling.max_tokens:
        raise ConfigError(f"trainer.overlong_buffer: {cfg.trainer.overlong_buffer} must be below sampling.max_tokens="
                          f"{cfg.sampling.max_tokens}")
    if cfg.trainer.offload_optimizer and cfg.trainer.zero_stage == 0:
        raise ConfigError("trainer.offload_optimizer: needs trainer.zero_stage 1-3 (DeepSpeed offloads ZeRO's "
                          "optimizer partitions); set trainer.zero_stage: 3 to shard the weights too")
    if cfg.trainer.compile and cfg.trainer.zero_stage == 3:
        raise ConfigError("trainer.compile: not with trainer.zero_stage 3 (its parameter hooks inside each layer break "
                          "the compiled graphs into pieces, each compiled again for every layer); use stage 0-2")
    check_loss(cfg.trainer)
    for name in ("token_mask", "seq_mask"):
        bounds = getattr(cfg.trainer, name)
        if bounds is not None and not (len(bounds) == 2 and 0 <= bounds[0] < 1 < bounds[1]):
            raise ConfigError(f"trainer.{name}: expected [low, high] with 0 <= low < 1 < high, got {bounds!r}")
    if cfg.eval.every and cfg.eval.data is None and not cfg.data.path.startswith("builtin:"):
        raise ConfigError("eval.data: needed with eval.every > 0 (the held-out prompts: a split or a file)")
    lora = cfg.model.lora
    if cfg.generator.lora_mode == "adapter" and lora is None:
        raise ConfigError("generator.lora_mode: adapter serves a LoRA adapter, and model.lora is not set")
    if cfg.generator.lora_mode == "adapter" and lora.modules_to_save:
        raise ConfigError(f"model.lora.modules_to_save: {lora.modules_to_save} cannot be served as a vLLM LoRA adapter "
                          "(generator.lora_mode adapter); use generator.lora_mode merged, or leave them out")
    if cfg.generator.lora_mode == "adapter" and lora.r > 512:
        raise ConfigError(f"model.lora.r: {lora.r} is above the largest rank vLLM serves (512) in generator.lora_mode "
                          "adapter; use generator.lora_mode merged")
    if cfg.model.quantization is not None:
        check_quantization(cfg)
    if not cfg.rewards:
        raise ConfigError("rewards: at least one reward function is needed")
    g = cfg.generator
    if g.rollout in ("agent", "environment"):  # their names before the other shipped strategies' builtin: ones
        raise ConfigError(f"generator.rollout: {g.rollout!r} is now named 'builtin:{g.rollout}', as the other shipped "
                          f"strategies are; write generator.rollout: builtin:{g.rollout}")
    if ":" not in g.rollout:
        raise ConfigError(f"generator.rollout: expected 'module:function' or 'builtin:NAME', got {g.rollout!r}")
    if g.rollout == "builtin:agent" and bool(g.agent) == bool(g.agent_command):
        raise ConfigError("generator.rollout builtin:agent: set one of generator.agent ('module:function' of an async "
                          "agent(client, item)) and generator.agent_command (a command line), not "
                          + ("both" if g.agent else "neither"))
    if (g.agent or g.agent_command) and g.rollout != "builtin:agent":
        raise ConfigError(f"generator.agent / agent_command: set, but generator.rollout is {g.rollout!r}; use "
                          "generator.rollout: builtin:agent")
    if g.agent_workers < 0:
        raise ConfigError(f"generator.agent_workers: {g.agent_workers} is below 0; 0 runs the agents on the "
                          "generator's loop, N in N processes")
    if g.agent_workers and g.rollout != "builtin:agent":
        raise ConfigError(f"generator.agent_workers: {g.agent_workers}, but generator.rollout is {g.rollout!r}: only "
                          "rollout builtin:agent runs its agents in worker processes; leave it out")
    if g.agent and ":" not in g.agent:
        raise ConfigError(f"generator.agent: expected 'module:function', got {g.agent!r}")
    check_environment(g)
    check_shared_gpus(cfg)
    check_builtin_data(cfg)
    check_reasoning_gym(cfg)
    if cfg.weights.transport not in ("auto", *TRANSPORTS):
        raise ConfigError(f"weights.transport: {cfg.weights.transport!r} is not one of "
                          f"{', '.join(map(repr, ('auto', *TRANSPORTS)))}")
    for i, r in enumerate(cfg.rewards):
        if ":" not in r.fn:
            raise ConfigError(f"rewards[{i}].fn: expected 'module:function', got {r.fn!r}")
    named = [(f"rewards[{i}].fn", r.fn) for i, r in enumerate(cfg.rewards)]
    for key, spec in named + [("generator.rollout", g.rollout), ("generator.agent", g.agent),
                              ("generator.environment", g.environment)]:
        try:
            builtin.module_path(spec)
        except ValueError as e:  # `builtin:` with a name there is not
            raise ConfigError(f"{key}: {e}") from None


SHARED_GPU = 0.95  # of a GPU, the generators' shares together at most: each engine's CUDA context is beyond its share


def check_shared_gpus(cfg) -> None:
    """The generators `pipeline run` puts on one GPU (run.generator_gpus, in turn) each take
    generator.gpu_memory_utilization of it, and vLLM refuses an engine whose share exceeds the memory free at its
    start: a second engine would fail minutes into the run, once the first had built."""
    share = cfg.generator.gpu_memory_utilization
    on = Counter(gpu for i in range(cfg.run.generators) if (gpus := cfg.run.gpus_of(i)) for gpu in gpus.split(","))
    gpu, n = on.most_common(1)[0] if on else ("", 0)
    if n > 1 and n * share > SHARED_GPU:
        most = math.floor(SHARED_GPU / n * 100) / 100
        raise ConfigError(f"generator.gpu_memory_utilization: {share:g} for each of the {n} generators that "
                          f"run.generators and run.generator_gpus put on GPU {gpu} is {n * share:.2f} of it; vLLM "
                          "refuses an engine whose share exceeds the memory the engines before it left free. Set "
                          f"generator.gpu_memory_utilization to {most:g} or less, or give each generator a GPU of "
                          "its own (run.generator_gpus)")


def check_loss(t) -> None:
    """trainer.loss's own knobs set only with it: one set for another loss would change nothing, silently."""
    tau_default = next(f.default for f in dataclasses.fields(t) if f.name == "m2po_tau")
    if t.loss != "m2po" and t.m2po_tau != tau_default:
        raise ConfigError(f"trainer.m2po_tau: set to {t.m2po_tau}, but trainer.loss is {t.loss!r} and only m2po reads "
                          "it; use trainer.loss: m2po, or leave trainer.m2po_tau out")


def check_environment(g) -> None:
    """builtin:environment's fields: its factory named, the tool parser one vLLM has, the template a file."""
    if g.rollout == "builtin:environment" and ":" not in g.environment:
        raise ConfigError(f"generator.environment: rollout builtin:environment needs the 'module:factory' of a TRL "
                          f"environment_factory class, got {g.environment!r}")
    if g.environment and g.rollout != "builtin:environment":
        raise ConfigError(f"generator.environment: set, but generator.rollout is {g.rollout!r}; use "
                          "generator.rollout: builtin:environment")
    if g.chat_template and not os.path.isfile(g.chat_template):
        raise ConfigError(f"generator.chat_template: {g.chat_template!r} is not a file (a Jinja chat template, as "
                          "vLLM's --chat-template)")
    if g.max_tool_calls < 0:
        raise ConfigError(f"generator.max_tool_calls: must be >= 0, got {g.max_tool_calls}")


def _datasets(cfg) -> list[tuple[str, Any]]:
    """(field, DataConfig) of the training data and, when set, the evaluation's."""
    return [("data", cfg.data)] + ([("eval.data", cfg.eval.data)] if cfg.eval.data is not None else [])


def check_builtin_data(cfg) -> None:
    """A `builtin:` data.path (or eval.data.path) is one of pipeline/tasks.py's, found here, not by the learner once
    its model is loaded."""
    for field, d in _datasets(cfg):
        if d.path.startswith("builtin:") and d.path not in builtin.DATASETS:
            hint = did_you_mean(d.path, builtin.DATASETS)
            raise ConfigError(f"{field}.path: {d.path!r} is not a builtin dataset{hint}; there are "
                              f"{', '.join(builtin.DATASETS)}, or give a .jsonl/.json/.parquet file or a Hugging Face "
                              "dataset")


RG_PIP = "pip install 'reasoning-gym==0.1.25'"  # the version pyproject.toml's reasoning-gym extra pins


def check_reasoning_gym(cfg) -> None:
    """builtin:reasoning_gym's data (training's or eval's) and its reward: reasoning-gym installed, and `data.name`
    one of its datasets (None: its default, pipeline/builtin.py REASONING_GYM_DEFAULT)."""
    for f, d in _datasets(cfg):
        if d.options and d.path != "builtin:reasoning_gym":
            raise ConfigError(f"{f}.options: only builtin:reasoning_gym reads dataset settings; {f}.path is "
                              f"{d.path!r}: leave them out")
    data = [(f, d) for f, d in _datasets(cfg) if d.path == "builtin:reasoning_gym"]
    rewards = [f"rewards[{i}].fn" for i, r in enumerate(cfg.rewards) if r.fn == "builtin:reasoning_gym_reward"]
    if not data and not rewards:
        return
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        field = f"{data[0][0]}.path" if data else rewards[0]
        raise ConfigError(f"{field}: builtin:reasoning_gym needs the PyPI package reasoning-gym ({e}): {RG_PIP}, or "
                          "pip install -e '.[reasoning-gym]'") from None
    for field, d in data:
        if d.name is not None and d.name not in DATASETS:
            hint = did_you_mean(d.name, DATASETS)
            raise ConfigError(f"{field}.name: {d.name!r} is not a reasoning-gym dataset{hint}; there are "
                              f"{', '.join(sorted(DATASETS))}")
        if d.options:
            check_reasoning_gym_options(field, d.name or builtin.REASONING_GYM_DEFAULT, d.options, DATASETS)


def check_reasoning_gym_options(field: str, name: str, options: dict, datasets: dict) -> None:
    """`options` as the fields of dataset `name`'s config class, each value through the config's own validate()."""
    config_cls = datasets[name][1]
    known = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in options:
        if key not in known:
            raise ConfigError(f"{field}.options: {key!r} is not a setting of reasoning-gym's {name}"
                              f"{did_you_mean(key, known)}; it has {', '.join(known)}")
    try:
        config_cls(**options, seed=0, size=1).validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ConfigError(f"{field}.options: reasoning-gym's {name} refuses {options}: {e or type(e).__name__}") \
            from None


def check_quantization(cfg) -> None:
    q = cfg.model.quantization
    if cfg.model.lora is None:
        raise ConfigError(f"model.quantization: {q} freezes a quantized base, which trains only through adapters "
                          "(QLoRA): set model.lora too (`model.lora: {}` takes its defaults)")
    if cfg.trainer.zero_stage == 3:
        raise ConfigError("trainer.zero_stage: 3 shards every parameter, and bitsandbytes' quantized weights cannot "
                          "be sharded (model.quantization); use stage 0-2: the base is frozen and holds no optimizer "
                          "state, so ZeRO-3 would save little")
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("bitsandbytes")
    except PackageNotFoundError:
        have = None
    if have is None or tuple(int(x) for x in have.split(".")[:2]) < (0, 48):
        raise ConfigError(f"model.quantization: {q} needs bitsandbytes >= 0.48 (found {have or 'none'}): "
                          "pip install 'bitsandbytes>=0.48'")
