"""Checkpoints: the DeepSpeed engine state plus the hub's state (version, ledger, pending prompts).

RUN_DIR/checkpoints/v{N}/ holds DeepSpeed's files, hub.json and weights.json; RUN_DIR/checkpoints/latest names
the newest complete one (written last, atomically, once every rank has saved), so a crash mid-save
leaves the previous one. Every rank saves (DeepSpeed's save is collective: each rank writes its own
shards); rank 0 writes hub.json, `latest`, and removes all but the newest `keep` checkpoints up to it (never the
one `latest` names).

weights.json says what the weights mean (`meaning`): their kind, the fingerprint of the base model's files
(pipeline/fingerprint.py) and its format, dtype, quantization, and for LoRA r, alpha, use_rslora, target_modules and
modules_to_save; and what trained them: the content digests of the code and files the config names
(pipeline/pinning.py: rewards, rollout, agent, environment, chat template). A resume hashes the files now the way the
checkpoint's fingerprint was (format 1 where it records none: written before generation_config.json and shard
indexes were hashed). `check_resume` refuses, before anything starts, a resume whose config differs from the run's
config.yaml outside what may differ (pipeline/runspec.py, RESUMABLE), whose model or adapter differs from the
checkpoint's, or whose reward (rollout, ...) source differs from the checkpoint's, naming the field;
an adapter is loaded strictly (every trained tensor from the checkpoint, nothing else in it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.fingerprint import FORMAT


class CheckpointError(RuntimeError):
    pass


def meaning(cfg, fingerprint: str, kind: str, contents: dict[str, str] | None = None,
            form: int = FORMAT) -> dict:
    """What a checkpoint's weights mean (weights.json). `kind`: what the run trains (learner/versions.py), `full`,
    `lora` or `lora-4bit`/`lora-8bit` (on a quantized base); `fingerprint`: of the base model's weight files, hashed
    the way `form` says (pipeline/fingerprint.py); `contents`: the content digests of the code and files the config
    names (pipeline/pinning.py), under "contents"."""
    m = cfg.model
    out = {"kind": kind, "model.path": fingerprint, "fingerprint_format": form, "model.dtype": m.dtype,
           "model.quantization": m.quantization}
    if m.lora is not None:
        out.update({f"model.lora.{k}": getattr(m.lora, k) for k in LORA_MEANING})
    if contents is not None:
        out["contents"] = dict(contents)
    return out


LORA_MEANING = ("r", "alpha", "use_rslora", "target_modules", "modules_to_save")


def save(engine, run_dir: Path, version: int, hub_state: dict | None, rank: int, keep: int = 2,
         what: dict | None = None) -> Path:
    """`what`: the weights' `meaning`. A LoRA checkpoint holds the adapter and its optimizer state, not the frozen
    base (which the run loads from model.path)."""
    what = what or {"kind": "full"}
    kind = what["kind"]
    import torch.distributed as dist

    root = run_dir / "checkpoints"
    tag = f"v{version}"
    engine.save_checkpoint(str(root), tag=tag, save_latest=False, exclude_frozen_parameters=kind != "full")
    if dist.is_initialized():
        dist.barrier()  # every rank's shards are on disk before `latest` names them
    if rank == 0:
        (root / tag / "hub.json").write_text(json.dumps(hub_state))
        (root / tag / "weights.json").write_text(json.dumps(what))
        tmp = root / "latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / "latest")
        _prune(root, version, keep)
    return root / tag


def _prune(root: Path, version: int, keep: int) -> None:
    """Keep the newest `keep` checkpoints up to `version`, the one `latest` now names. Tags above it are of
    steps this run no longer has (it was resumed from an older checkpoint: a crash mid-save, or a kill after
    them); sorted by number they would push out the checkpoints being written, `latest`'s own among them."""
    tags = sorted(_tags(root), key=lambda t: int(t[1:]))
    older = [t for t in tags if int(t[1:]) <= version]
    for old in older[:-keep] + [t for t in tags if int(t[1:]) > version]:
        shutil.rmtree(root / old, ignore_errors=True)


def _tags(root: Path) -> list[str]:
    return [p.name for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit()]


KINDS = {"full": "every weight (a full-weight run)", "lora": "a LoRA adapter (a model.lora run)",
         "lora-4bit": "a LoRA adapter of a 4-bit base (model.quantization 4bit)",
         "lora-8bit": "a LoRA adapter of an 8-bit base (model.quantization 8bit)"}


def check_resume(cfg, run_dir: Path) -> list[str]:
    """Refuse (CheckpointError, naming the field) a resume of RUN_DIR with `cfg` that would train another run: a field
    that differs from RUN_DIR/config.yaml and may not (pipeline/runspec.py, RESUMABLE), or a model or adapter other
    than the newest checkpoint's. Runs in the command's process, before any rank or service starts. Returns what the
    resume changes that it may (`key: old -> new`)."""
    from pipeline.config import load_config
    from pipeline.runspec import resume_conflict, resumed_changes

    saved, changes = run_dir / "config.yaml", []
    if saved.exists():
        first = load_config(saved)
        if why := resume_conflict(cfg, first, str(saved)):
            raise CheckpointError(f"--resume {run_dir}: {why}")
        changes = resumed_changes(cfg, first)
    tag, recorded = _recorded(run_dir)
    check_contents(cfg, run_dir, tag, recorded.get("contents"))
    from pipeline.fingerprint import of_model

    form = recorded.get("fingerprint_format", 1)  # hashed the files the first way, or says how
    if form not in (1, FORMAT):
        raise CheckpointError(f"--resume {run_dir}: checkpoint {tag} records its base's fingerprint in format "
                              f"{form!r}, which this release cannot compute (it knows 1 and {FORMAT}): resume with the "
                              "release that wrote it")
    fingerprint = of_model(cfg.model, form)["model.path"] if "model.path" in recorded else ""
    ours = meaning(cfg, fingerprint, run_kind(cfg), form=form)
    for key, value in recorded.items():  # a checkpoint written before a field was recorded is not held to it
        if key not in ("kind", "contents") and ours.get(key) != value:
            what = "its files' fingerprint" if key == "model.path" else key
            raise CheckpointError(
                f"--resume {run_dir}: checkpoint {tag} was trained with {what} {value!r}, this config has "
                f"{ours.get(key)!r} (model.path {cfg.model.path}): its weights mean something else under it. Resume "
                f"with the run's own config ({saved}, the default without -c) and model files, or start another run")
    return changes


def check_contents(cfg, run_dir: Path, tag: str, recorded: dict | None) -> None:
    """Refuse (CheckpointError, naming the field) a resume whose reward, rollout, agent or environment source or chat
    template differs from what trained checkpoint `tag` (`recorded`, its weights.json's "contents"; None: written
    before they were recorded, not held to them). Refused, not warned: a reward's name is not RESUMABLE, and another
    source under it scores the resumed steps differently from the ones before."""
    if not isinstance(recorded, dict):
        return
    from pipeline.pinning import content_conflict, content_digests

    fix = "a resume continues the run it resumes; restore what it started with, or start another run"
    if why := content_conflict(content_digests(cfg), recorded, cfg, "this host", f"checkpoint {tag}", fix):
        raise CheckpointError(f"--resume {run_dir}: {why}")


def run_kind(cfg) -> str:
    """The kind of weights a config trains (KINDS; learner/versions.py's version kinds carry these names)."""
    return "full" if cfg.model.lora is None else adapter_kind(cfg.model.quantization)


def adapter_kind(quantization: str | None) -> str:
    """An adapter's kind: `lora`, or on a quantized base `lora-4bit` / `lora-8bit`."""
    return "lora" if quantization is None else f"lora-{quantization}"


def _recorded(run_dir: Path) -> tuple[str, dict]:
    root = Path(run_dir) / "checkpoints"
    try:
        tag = (root / "latest").read_text().strip()
        info = root / tag / "weights.json"
        return tag, json.loads(info.read_text()) if info.exists() else {"kind": "full"}  # written since LoRA came
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--resume {run_dir}: no readable checkpoint ({e})") from None


def load(engine, run_dir: Path, kind: str = "full") -> tuple[int, dict]:
    """Restore the engine from the newest checkpoint; returns (version, hub state). A checkpoint of the other kind
    (full weights where the config says model.lora, or the other way) is refused with the reason; an adapter is loaded
    strictly: every trained tensor of the model from the checkpoint, and no adapter tensor the model lacks."""
    root = Path(run_dir) / "checkpoints"
    tag, recorded = _recorded(run_dir)
    try:
        hub_state = json.loads((root / tag / "hub.json").read_text())
        saved = recorded["kind"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"--resume {run_dir}: no readable checkpoint ({e})") from None
    if saved != kind:
        raise CheckpointError(f"--resume {run_dir}: checkpoint {tag} holds {KINDS.get(saved, saved)}, but this config "
                              f"trains {KINDS[kind]}: resume with the run's own config ({run_dir}/config.yaml, the "
                              "default without -c), or start another run")
    if kind != "full":
        _check_adapter_keys(root / tag, engine.module)
    path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False,
                                     load_module_strict=kind == "full")  # a LoRA checkpoint holds no base
    if path is None:
        raise CheckpointError(f"--resume {run_dir}: DeepSpeed could not load checkpoint {root / tag}")
    return int(tag[1:]), hub_state


def _check_adapter_keys(ckpt: Path, module) -> None:
    """The trained tensors a LoRA checkpoint holds are exactly the model's (loaded non-strictly, since the frozen base
    is not in it, a missing adapter tensor would keep its initial value unnoticed)."""
    import torch

    files = sorted(ckpt.glob("*model_states.pt"))  # mp_rank_00_..., under ZeRO-3 zero_pp_rank_N_mp_rank_00_...
    if not files:
        return
    state = torch.load(files[0], map_location="cpu", weights_only=False).get("module") or {}
    held = {k for k in state if k not in _frozen_keys(module)}
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    if not held:  # ZeRO-3 keeps the trained tensors in its partitions, not here: DeepSpeed checks those itself
        return
    missing, extra = sorted(trained - held), sorted(held - trained)
    if missing or extra:
        raise CheckpointError(f"checkpoint {ckpt}: its adapter tensors are not the model's ({len(missing)} missing, "
                              f"e.g. {missing[:2]}; {len(extra)} not in the model, e.g. {extra[:2]}): another "
                              "model.lora (target_modules, modules_to_save) than the run's")


def _frozen_keys(module) -> set[str]:
    return {n for n, p in module.named_parameters() if not p.requires_grad} | {n for n, _ in module.named_buffers()}
