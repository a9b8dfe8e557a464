"""What a weights version is made of, two kinds behind one interface: every parameter (`FullVersion`), or, with
`model.lora`, the LoRA adapter alone (`AdapterVersion`), trained with PEFT on a frozen base (`wrap`).

A kind gives the publisher (learner/publisher.py) the (name, parameter) pairs it announces (`named`) and the
tensors it gathers and sends (`gathered`), and writes `final/` (`save_final`). An adapter version names each
tensor after the base checkpoint's own weight, so a receiver needs nothing but the base to merge it:

    model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]    for  model.layers.0.self_attn.q_proj.weight
    model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]   already scaled by alpha / r: W = W0 + B A
    lm_head.weight                                             a module of modules_to_save, whole

(PEFT's own names, `base_model.model.<name>.lora_A.default.weight`, carry its wrapper and the adapter's name.) The
generator merges them into its engine's weights (generator/merge.py). The base never changes: the learner casts it
to the run's dtype and gives it no gradient and no optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from learner.model import gathered_weights, save_hf
from pipeline.validate import ConfigError

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # PEFT's name of the one adapter


def wrap(model, lora, dtype: torch.dtype):
    """The PEFT model of `model` with `lora` (pipeline.config.LoraConfig): target modules that match nothing, or
    that cannot be merged into the engine's weights, are refused naming the field."""
    from peft import LoraConfig, get_peft_model

    if lora.target_modules == [] or lora.target_modules == "":
        raise ConfigError("model.lora.target_modules: empty; name modules (q_proj, v_proj, ...) or all-linear")
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    peft_cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules, modules_to_save=lora.modules_to_save or None,
                          use_rslora=lora.use_rslora, task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, peft_cfg)
    except ValueError as e:  # "Target modules {...} not found in the base model"
        raise ConfigError(f"model.lora.target_modules: {e}") from None
    for name, module in peft_model.named_modules():
        base = getattr(module, "base_layer", None)
        if base is not None and (base is head or base is embed or isinstance(base, torch.nn.Embedding)):
            raise ConfigError(f"model.lora.target_modules: {_plain(name)} is the model's input embedding or output "
                              "head, which an adapter version cannot be merged into (tied to the embedding in many "
                              "models); leave it out, or train it whole with modules_to_save")
    saved = [n for n, _ in peft_model.named_modules() if n.endswith(f".modules_to_save.{ADAPTER}")]
    for want in lora.modules_to_save:
        if not any(_plain(n).removesuffix(f".modules_to_save.{ADAPTER}").split(".")[-1] == want.split(".")[-1]
                   for n in saved):
            raise ConfigError(f"model.lora.modules_to_save: {want!r} matches no module of the model")
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and any(_plain(n).split(".")[-3] in ("lm_head", "embed_tokens") for n in saved):
        raise ConfigError("model.lora.modules_to_save: the output head and the input embedding are one tensor in "
                          "this model (tie_word_embeddings); training one whole would untie them")
    for p in peft_model.parameters():  # the frozen base in the run's dtype (the trained ones: MixedAdamW, DeepSpeed)
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    return peft_model


def _plain(peft_name: str) -> str:
    return peft_name.removeprefix(PEFT_PREFIX)


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

    kind = "lora"

    def __init__(self, module):
        self.module = module
        self.entries = []  # (version name, parameter, scale of lora_B or None)
        for name, p in module.named_parameters():
            if p.requires_grad:
                self.entries.append((*_version_name(module, name), p))

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
            self.module.merge_and_unload().save_pretrained(merged)  # the run is over: merged in place
            if tokenizer is not None:
                tokenizer.save_pretrained(merged)


def _version_name(module, peft_name: str) -> tuple[str, float | None]:
    """(name in a version, the scale to apply) of a trained PEFT parameter."""
    name = _plain(peft_name)
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{ADAPTER}."
        if marker in name:
            owner, rest = name.split(marker)
            scale = module.get_submodule(PEFT_PREFIX + owner).scaling[ADAPTER] if part == "lora_B" else None
            return f"{owner}.{part}.{rest}", scale
    marker = f".modules_to_save.{ADAPTER}."
    if marker in name:
        owner, rest = name.split(marker)
        return f"{owner}.{rest}", None
    raise ValueError(f"model.lora: trained parameter {peft_name} is neither an adapter's nor of modules_to_save "
                     "(DoRA and trained biases cannot be merged into the engine's weights)")


def version_kind(cfg, module):
    """The kind of version this run publishes: the adapter with model.lora, else every parameter."""
    return AdapterVersion(module) if cfg.model.lora is not None else FullVersion(module)
