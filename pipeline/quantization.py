"""QLoRA (model.quantization): the learner's frozen base quantized by bitsandbytes, and the same base as the
generators serve it.

The learner loads model.path with `bnb_config`: 4bit is NF4 with double quantization in blocks of 64, computing in
the run's dtype (QLoRA's settings, and what TRL's users pass); 8bit is LLM.int8. Each linear layer it quantizes
(`quantized_names`: all but those transformers keeps whole, the output head among them) then computes with W', the
quantized W dequantized, not with W.

An engine that served W would sample from another model than the one trained: the train-inference mismatch would
be the quantization error. So a generator of a quantized run loads W' into its engine at start, computed from the
same checkpoint by the same bitsandbytes functions (`learner_base`), and adapter versions go onto W' (merged) or
beside it (adapter mode). With 4bit the two sides hold the same base bit for bit; LLM.int8 also rounds the learner's
activations to 8 bits, which the engine does not, so with 8bit they differ by that. The engine holds W' in the run's
dtype, the memory of an unquantized model: vLLM's own bitsandbytes serving quantizes with settings of its own, and
would serve another base again.
"""

from __future__ import annotations

import torch

BLOCK = 64  # NF4 block size, bitsandbytes' default and QLoRA's


def bnb_config(quantization: str, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def quantized_names(model_path: str, quantization: str) -> list[str]:
    """The checkpoint weights that loading `model_path` with `bnb_config(quantization)` quantizes, found as
    transformers finds them (on a model of no memory, from the config alone)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        skip = HfQuantizer.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules)
        replace_with_bnb_linear(model, modules_to_not_convert=skip,
                                quantization_config=bnb_config(quantization, torch.float32))
    return quantized_modules(model)


def exact_on_cpu(model) -> None:
    """Keep every 4-bit layer computing in bnb_4bit_compute_dtype on the CPU. bitsandbytes 0.50 on a CPU with
    AVX512-BF16 repacks a 4-bit weight the first time its layer runs in eval mode without a gradient, and from then on
    computes that layer in bf16, training's forwards included (its fused kernel passes no gradient to the layer's
    input): the learner's no-gradient passes (the KL reference, proximal log-probs) would leave it computing with
    another base than the generators serve. Off, every forward dequantizes into the compute dtype."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantized_modules(model) -> list[str]:
    """The weight names of `model`'s bitsandbytes layers."""
    import bitsandbytes as bnb

    return [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit,
                                                                                   bnb.nn.Linear8bitLt))]


def learner_base(w: torch.Tensor, quantization: str) -> torch.Tensor:
    """W' of a checkpoint weight `w` (in the run's dtype): what the learner's quantized layer computes with."""
    import bitsandbytes.functional as F

    if quantization == "4bit":  # bitsandbytes' Params4bit with bnb_config's settings
        packed, state = F.quantize_4bit(w.contiguous(), blocksize=BLOCK, compress_statistics=True, quant_type="nf4")
        return F.dequantize_4bit(packed, state).to(w.dtype)
    rows, scales, _ = F.int8_vectorwise_quant(w.to(torch.float16))  # Int8Params: per-row absmax of the fp16 weight
    return (rows.float() * scales[:, None].float() / 127).to(w.dtype)


def dequantized_model(model_path: str, quantization: str, dtype: torch.dtype):
    """An ordinary model of `model_path` whose quantized weights are W': the learner's base, unquantized (for
    final-merged/ of a quantized run: PEFT would merge into the 4-bit weights and round the sum to 4 bits again)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in quantized_names(model_path, quantization):
            params[name].copy_(learner_base(params[name].data, quantization))
    return model
