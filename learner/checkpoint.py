"""Checkpoints: the DeepSpeed engine state plus the hub's state (version, ledger, pending prompts).

RUN_DIR/checkpoints/v{N}/ holds DeepSpeed's files and hub.json; RUN_DIR/checkpoints/latest names
the newest complete one (written last, atomically, once every rank has saved), so a crash mid-save
leaves the previous one. Every rank saves (DeepSpeed's save is collective: each rank writes its own
shards); rank 0 writes hub.json, `latest`, and removes all but the newest `keep` checkpoints up to it (never the
one `latest` names).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class CheckpointError(RuntimeError):
    pass


def save(engine, run_dir: Path, version: int, hub_state: dict | None, rank: int, keep: int = 2,
         kind: str = "full") -> Path:
    """`kind`: what the run trains (learner/versions.py), `full`, `lora` or `lora-4bit`/`lora-8bit` (on a quantized
    base); a LoRA checkpoint holds the adapter and its optimizer state, not the frozen base (which the run loads from
    model.path)."""
    import torch.distributed as dist

    root = run_dir / "checkpoints"
    tag = f"v{version}"
    engine.save_checkpoint(str(root), tag=tag, save_latest=False, exclude_frozen_parameters=kind != "full")
    if dist.is_initialized():
        dist.barrier()  # every rank's shards are on disk before `latest` names them
    if rank == 0:
        (root / tag / "hub.json").write_text(json.dumps(hub_state))
        (root / tag / "weights.json").write_text(json.dumps({"kind": kind}))
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


def load(engine, run_dir: Path, kind: str = "full") -> tuple[int, dict]:
    """Restore the engine from the newest checkpoint; returns (version, hub state). A checkpoint of the other kind
    (full weights where the config says model.lora, or the other way) is refused with the reason."""
    root = Path(run_dir) / "checkpoints"
    try:
        tag = (root / "latest").read_text().strip()
        hub_state = json.loads((root / tag / "hub.json").read_text())
        info = root / tag / "weights.json"
        saved = json.loads(info.read_text())["kind"] if info.exists() else "full"  # written since LoRA came
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"--resume {run_dir}: no readable checkpoint ({e})") from None
    if saved != kind:
        raise CheckpointError(f"--resume {run_dir}: checkpoint {tag} holds {KINDS.get(saved, saved)}, but this config "
                              f"trains {KINDS[kind]}: resume with the run's own config ({run_dir}/config.yaml, the "
                              "default without -c), or start another run")
    path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False,
                                     load_module_strict=kind == "full")  # a LoRA checkpoint holds no base
    if path is None:
        raise CheckpointError(f"--resume {run_dir}: DeepSpeed could not load checkpoint {root / tag}")
    return int(tag[1:]), hub_state
