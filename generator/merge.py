"""An adapter version merged into the engine's weights, inside each vLLM worker (generator.worker_ext).

An adapter version (learner/versions.py; its names: weights/plan.py) names lora_A and lora_B after the base weight
they change, lora_B already scaled: `model.layers.0.mlp.up_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r] for `model.layers.0.mlp.up_proj.weight`. `Merger` turns them into that weight, W0 + B A, computed in fp32
from the base in the engine's dtype (as the learner holds it) and rounded once, and hands the result to the same
loader as a full version's tensors: vLLM's own, which packs q/k/v and gate/up and shards for tensor parallelism.
Tensors of other names (modules_to_save) pass through whole. Only the adapter travels; the engine runs no LoRA
kernels.

The base weights of the adapted modules are read once from the model's checkpoint (the safetensors files of
the directory the engine loaded) and kept on the worker's device: the engine's own weights are no longer the
base once a version is merged. That copy is the mode's memory cost, about the model's size with all-linear.

With model.quantization (QLoRA) the base is the learner's, W' (pipeline/quantization.py): `learner_base_weights`
gives every weight the learner quantized as W', which the worker loads into the engine at start, in both
generator.lora_mode's; the Merger merges onto W'. Nothing is ever merged into quantized weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pipeline.quantization import learner_base, quantized_names
from weights.plan import LORA_A, LORA_B


class Merger:
    def __init__(self, model: str, dtype: torch.dtype, device, quantization: str | None = None):
        self.dir, self.dtype, self.device = _local_dir(model), dtype, device
        self.quantization = quantization
        self.quantized = set(quantized_names(str(self.dir), quantization)) if quantization else set()
        self.base: dict[str, torch.Tensor] = {}

    def __call__(self, named: list) -> Iterator[tuple[str, torch.Tensor]]:
        """The version's weights to load: checked whole first, then each merged weight made as the loader takes it,
        so one merged weight at a time lies beside the engine's (a list of them all was the model's size again: the
        7B QLoRA generator peaked at 47 GB, its cap 40)."""
        a = {n.removesuffix(LORA_A): t for n, t in named if n.endswith(LORA_A)}
        b = {n.removesuffix(LORA_B): t for n, t in named if n.endswith(LORA_B)}
        if a.keys() != b.keys():
            raise ValueError(f"adapter version: lora_A and lora_B name different modules "
                             f"({sorted(a.keys() ^ b.keys())[:3]})")
        self._load_base([f"{owner}.weight" for owner in a if f"{owner}.weight" not in self.base])
        for owner, lora_a in a.items():
            shape, base = [b[owner].shape[0], lora_a.shape[-1]], list(self.base[f"{owner}.weight"].shape)
            if shape != base:
                raise ValueError(f"adapter version: {owner} gives B A of shape {shape}, the base weight is {base}")
        return self._merged(named, a, b)

    def _merged(self, named: list, a: dict, b: dict) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((n, t) for n, t in named if not n.endswith((LORA_A, LORA_B)))
        for owner, lora_a in a.items():
            w0 = self.base[f"{owner}.weight"]
            delta = b[owner].to(w0.device, torch.float32) @ lora_a.to(w0.device, torch.float32)
            yield f"{owner}.weight", (w0.float() + delta).to(self.dtype)

    def _load_base(self, names: list[str]) -> None:
        """The base weights `names` from the checkpoint, in the engine's dtype, on the worker's device."""
        if not names:
            return
        self.base.update(_read(self.dir, names, self.dtype, self.device, self.quantized, self.quantization))


def learner_base_weights(model: str, dtype: torch.dtype, device,
                         quantization: str) -> tuple[list[str], Iterator[tuple[str, torch.Tensor]]]:
    """(the names of every weight the learner of a quantized run quantized, each as W': its base as it computes
    with it). The weights come one at a time as the loader takes them: all at once they were the model's size again
    beside the engine's."""
    root = _local_dir(model)
    names = quantized_names(str(root), quantization)
    return names, _read(root, names, dtype, device, set(names), quantization)


def _read(root: Path, names: list[str], dtype: torch.dtype, device, quantized: set[str],
          quantization: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights `names` of the checkpoint in `root`, in `dtype` on `device`, each read as it is taken; those in
    `quantized` as W'. A name the checkpoint lacks is refused before any is read."""
    where = _index(root)
    missing = [n for n in names if n not in where]
    if missing:
        raise ValueError(f"adapter version: {root} holds no weight {missing[0]} (of {len(missing)} missing): "
                         "generator and learner must load the same model.path")
    return _tensors(root, names, where, dtype, device, quantized, quantization)


def _tensors(root: Path, names: list[str], where: dict[str, str], dtype: torch.dtype, device, quantized: set[str],
             quantization: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted({where[n] for n in names}):
        with safe_open(str(root / file), framework="pt", device="cpu") as f:
            for n in names:
                if where[n] == file:
                    w = f.get_tensor(n).to(device, dtype)
                    yield n, learner_base(w, quantization) if quantization and n in quantized else w


def _index(root: Path) -> dict[str, str]:
    """{tensor name: safetensors file} of a checkpoint directory, sharded or not."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    out = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out.update(dict.fromkeys(f.keys(), path.name))
    return out


def _local_dir(model: str) -> Path:
    """The directory of the checkpoint the engine loaded: a directory, or a hub name in the local cache."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))
