"""What a weights version is made of, two kinds behind one interface, picked once per run (`version_kind`): every
parameter under its own name (`FullVersion`), or with model.lora the adapter alone (`AdapterVersion`: each
target's lora_A and scaled lora_B named after the base weight, modules_to_save whole; learner/adapters.py says how
they are named, generator/merge.py how a generator merges them).

A kind gives the publisher (learner/publisher.py) the (name, parameter) pairs it announces (`named`: the manifest)
and the tensors it gathers and sends (`gathered`), and writes `final/` (`save_final`). Every transport, checksum and
announcement carries either kind unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from learner.adapters import version_name
from learner.checkpoint import adapter_kind
from learner.model import gathered_weights, run_dtype, save_hf


class FullVersion:
    """Every parameter, under its own (the checkpoint's) name."""

    kind = "full"

    def __init__(self, module):
        self.module = module

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.module.named_parameters())

    def gathered(self, engine, zero_stage: int) -> Iterator[tuple[str, torch.Tensor]]:
        return gathered_weights(engine, zero_stage)

    def save_final(self, engine, cfg, tokenizer, out_dir, rank: int) -> None:
        save_hf(engine, cfg, tokenizer, out_dir, rank)


class AdapterVersion:
    """The trained tensors of a PEFT model: each target's lora_A and lora_B (B scaled), and modules_to_save whole,
    named as the module docstring says."""

    def __init__(self, module, quantization: str | None = None):
        self.kind = adapter_kind(quantization)  # a checkpoint's (learner/checkpoint.py)
        self.module = module
        self.entries = []  # (version name, parameter, scale of lora_B or None)
        for name, p in module.named_parameters():
            if p.requires_grad:
                self.entries.append((*version_name(module, name), p))

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p) for name, _, p in self.entries]

    def gathered(self, engine, zero_stage: int) -> Iterator[tuple[str, torch.Tensor]]:
        pairs = [(name, p) for name, _, p in self.entries]
        for (name, t), (_, scale, _) in zip(gathered_weights(engine, zero_stage, pairs), self.entries, strict=True):
            yield name, (t if scale is None else t * scale)

    def save_final(self, engine, cfg, tokenizer, out_dir, rank: int) -> None:
        """final/: a PEFT adapter directory (`PeftModel.from_pretrained(base, dir)`); with model.lora.merged_final
        also final-merged/, the base with the adapter merged in. Every rank takes part in the gathers."""
        state, trained = {}, [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        for name, t in gathered_weights(engine, cfg.trainer.zero_stage, trained):
            if rank == 0:
                state[name] = t.to("cpu", copy=True)
        if rank != 0:
            return
        self.module.save_pretrained(out_dir, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        if cfg.model.lora.merged_final:
            merged = out_dir.parent / f"{out_dir.name}-merged"
            self.merged(cfg, out_dir).save_pretrained(merged)
            if tokenizer is not None:
                tokenizer.save_pretrained(merged)

    def merged(self, cfg, adapter_dir):
        """The base with the adapter merged in; with model.quantization, the learner's base W' (unquantized) with
        it, so that final-merged/ computes what was trained."""
        if cfg.model.quantization is None:
            return self.module.merge_and_unload()  # the run is over: merged in place
        from peft import PeftModel

        from pipeline.quantization import dequantized_model
        from pipeline.tinymodel import resolve_model_path

        base = dequantized_model(resolve_model_path(cfg.model.path), cfg.model.quantization, run_dtype(cfg))
        return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


def version_kind(cfg, module):
    """The kind of version this run publishes: the adapter with model.lora, else every parameter."""
    return AdapterVersion(module, cfg.model.quantization) if cfg.model.lora is not None else FullVersion(module)
