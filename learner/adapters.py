"""LoRA on the learner (model.lora): the model wrapped with PEFT (`wrap`), its adapters disabled for the KL
reference (`AdaptersOff`), and the names its trained tensors take in a version (`version_name`; the version itself
is learner/versions.py's `AdapterVersion`). A version names each tensor after the base checkpoint's own weight, so a
receiver needs nothing but the base to merge it:

    model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]    for  model.layers.0.self_attn.q_proj.weight
    model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]   already scaled by alpha / r: W = W0 + B A
    lm_head.weight                                             a module of modules_to_save, whole

(PEFT's own names, `base_model.model.<name>.lora_A.default.weight`, carry its wrapper and the adapter's name.) The
generator merges them into its engine's weights (generator/merge.py). The base never changes: the learner casts it
to the run's dtype and gives it no gradient and no optimizer state.
"""

from __future__ import annotations

import torch

from pipeline.validate import ConfigError
from weights.plan import LORA_A, LORA_B, PEFT_PREFIX

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
    saved = [_plain(n).removesuffix(".modules_to_save") for n, _ in peft_model.named_modules()
             if n.endswith(".modules_to_save")]
    for want in lora.modules_to_save:
        if not any(owner == want or owner.endswith(f".{want}") for owner in saved):
            raise ConfigError(f"model.lora.modules_to_save: {want!r} matches no module of the model")
    whole = [m.original_module for m in peft_model.modules() if hasattr(m, "original_module")]  # modules_to_save
    if getattr(model.config, "tie_word_embeddings", False) and any(m is head or m is embed for m in whole):
        raise ConfigError("model.lora.modules_to_save: the output head and the input embedding are one tensor in "
                          "this model (tie_word_embeddings); training one whole would untie them")
    for p in peft_model.parameters():  # the frozen base in the run's dtype (the trained ones: MixedAdamW, DeepSpeed)
        if not p.requires_grad and p.is_floating_point():  # (bitsandbytes' quantized weights are integers)
            p.data = p.data.to(dtype)
    return peft_model


def _plain(peft_name: str) -> str:
    return peft_name.removeprefix(PEFT_PREFIX)


class AdaptersOff:
    """A PEFT model called with its adapters disabled: the frozen base, the reference of trainer.kl_coef (no second
    copy of the model)."""

    def __init__(self, model):
        self.module = model  # (learner.logprobs asks the wrapped model what its forward takes)

    def __call__(self, **kwargs):
        with self.module.disable_adapter(), torch.no_grad():
            return self.module(**kwargs)


def version_name(module, peft_name: str) -> tuple[str, float | None]:
    """(name in a version, the scale to apply) of a trained PEFT parameter."""
    name = _plain(peft_name)
    for suffix in (LORA_A, LORA_B):  # PEFT's `X.lora_A.default.weight` is the version's `X.lora_A.weight`
        peft_suffix = suffix.replace(".weight", f".{ADAPTER}.weight")
        if name.endswith(peft_suffix):
            owner = name.removesuffix(peft_suffix)
            scale = module.get_submodule(PEFT_PREFIX + owner).scaling[ADAPTER] if suffix == LORA_B else None
            return owner + suffix, scale
    marker = f".modules_to_save.{ADAPTER}."
    if marker in name:
        owner, rest = name.split(marker)
        return f"{owner}.{rest}", None
    raise ValueError(f"model.lora: trained parameter {peft_name} is neither an adapter's nor of modules_to_save "
                     "(DoRA and trained biases cannot be merged into the engine's weights)")
