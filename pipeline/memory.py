"""What a generator's model takes of its GPU, worked out from its files before vLLM loads anything; and what a
learner's weights, gradients and optimizer state take of each rank's GPU (`check_learner`: ZeRO's stages shard them,
trainer.offload_optimizer moves Adam's state and the fp32 masters to the CPU; with model.lora, a frozen base and the
adapters' states, the base's linear layers in 4 or 8 bits with model.quantization; trainer.gpu_memory_gb is the card
where set; activations are not counted).

vLLM sizes its KV cache last: `gpu_memory_utilization` of the GPU's memory, less the weights, less what its
profiling run peaks at; a card too small fails there, minutes after the start, with "no memory available for the
cache blocks" or a KV-cache allocation error (TRL's users of 24 GB cards know it). `check_generator` refuses such a
config at the generator's start with the numbers, and gives the same line as the plan where it fits:

    Qwen2.5-7B-Instruct (7.62 B parameters) in bfloat16 needs 15.2 GB of weights on each of the generator's GPU;
    with gpu_memory_utilization 0.9 of 24.0 GB that leaves 4.4 GB of KV cache (after 2.0 GB for vLLM's activations
    and CUDA context) for 74 sequences of 1024 tokens

What it counts:
- Weights: from the headers of the safetensors files a loader reads (those model.safetensors.index.json names, else
  every *.safetensors), each tensor's values at the run's dtype; a quantized checkpoint (config.json's
  quantization_config: GPTQ, AWQ, bitsandbytes, FP8) and integer tensors at their stored bytes. Layers past
  num_hidden_layers (multi-token prediction, which vLLM skips) are left out. Pickled weights (*.bin, *.pt) by their
  sizes, at config.json's torch_dtype. With no weight files (a random-weights shape), the config arithmetic of a
  decoder: embeddings, attention (grouped KV heads, or DeepSeek's MLA), a gated MLP or mixture of experts (routed
  and shared experts, the router, the dense layers of first_k_dense_replace and kin), norms.
- The KV cache per token of a sequence: 2 x layers x KV heads x head size x bytes, the KV heads split over
  tensor_parallel_size but at least one on each GPU (vLLM replicates them); with MLA, layers x (kv_lora_rank +
  qk_rope_head_dim) x bytes on every GPU. Sliding-window and chunked layers (layer_types, sliding_window_pattern;
  every layer where the config gives a window and no pattern) hold at most the window.
- The LM's fields are text_config's where the top level lacks them (Gemma 3, Llava, Qwen2.5-VL).

What it skips, saying so in the line it returns: the KV cache of layers it does not model (state-space, linear
attention, KV shared across layers, cross-attention, encoder-decoders) or of a config lacking a field it needs; then
only the weights are checked. Where neither weight files nor the config give the weights, nothing is checked.

Each guess errs low: the check refuses only where even one sequence of generator.max_model_len cannot fit, so a
refusal is never wrong for want of a modeled feature. The overhead is an estimate, not vLLM's measure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ConfigError
from pipeline.fingerprint import local_dir, weight_files

GB = 1e9
OVERHEAD_BYTES = int(2 * GB)  # vLLM's profiled activations, CUDA graphs and the CUDA context, estimated
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FLOATS = ("F64", "F32", "F16", "BF16")  # safetensors' dtypes an engine loads in the run's dtype
ATTENTION = ("full_attention", "sliding_attention", "chunked_attention")  # the layer_types the KV arithmetic models
# fragments of config.json keys that name layers without a KV cache of one per layer (Jamba, Nemotron-H, Qwen3-Next,
# LFM2, MiniMax, RecurrentGemma, Gemma 3n, Hunyuan's cross-layer attention, Mllama)
UNMODELED = ("mamba", "ssm", "linear_", "conv_", "attn_layer_", "attn_type", "block_type", "hybrid_",
             "full_attention_interval", "kv_shared", "cla_", "cross_attention", "lru_")


class NotModeled(Exception):
    """What the arithmetic cannot count for this model, as a phrase: "config.json has no hidden_size"."""


@dataclass
class Footprint:
    params: int | None  # the whole model's; None for a quantized checkpoint, whose files hold packed values
    weight_bytes: int  # on each GPU of the tensor-parallel group
    kv_bytes_per_token: int  # on each GPU, in the layers that keep every token of a sequence
    window_kv_bytes_per_token: int = 0  # on each GPU, in the sliding-window and chunked layers
    window: int = 0  # tokens those layers keep at most
    kv_unmodeled: str = ""  # why the KV cache is not counted (then 0 above, and the weights alone are checked)

    def sequence_bytes(self, tokens: int) -> int:
        """The KV cache of one sequence of `tokens`, on each GPU."""
        return self.kv_bytes_per_token * tokens + self.window_kv_bytes_per_token * min(tokens, self.window)


def footprint(config: dict, dtype: str, tensor_parallel: int = 1, model_dir: Path | None = None) -> Footprint:
    """The footprint of the model of `config` (config.json's fields) served in `dtype`, its weights from the files
    in `model_dir` where there are some; NotModeled where neither these nor the config arithmetic give the weights."""
    lm, size = language_model(config), DTYPE_BYTES[dtype]
    quantized = _quantization(config)
    try:  # those a loader reads (pipeline/fingerprint.py); none: a random-weights shape, counted by its config
        files = weight_files(model_dir)[0] if model_dir is not None else []
    except FileNotFoundError:
        files = []
    try:
        if files:
            params, total = _file_weights(files, lm, size, quantized)
        elif quantized:
            raise NotModeled(f"a {quantized} checkpoint without weight files")
        else:
            params = _params(lm)
            total = params * size
    except (KeyError, TypeError) as e:
        raise NotModeled(_missing(e)) from e
    try:
        full, windowed, window = _kv(lm, size, tensor_parallel)
        unmodeled = ""
    except (NotModeled, KeyError, TypeError) as e:
        full = windowed = window = 0
        unmodeled = str(e) if isinstance(e, NotModeled) else _missing(e)
    return Footprint(params, total // tensor_parallel, full, windowed, window, unmodeled)


def language_model(config: dict) -> dict:
    """The language model's fields: the config's own, or its text_config's (multimodal wrappers) where the top level
    lacks them, with the wrapper's fields for those text_config leaves out."""
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        return {**config, **text}
    return config


def safetensors_header(path: Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file: its first 8 bytes give the length of
    the JSON header after them."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _file_weights(files: list[Path], lm: dict, size: int, quantized: str) -> tuple[int | None, int]:
    """(parameters, bytes) of the weights in `files` as the engine holds them, `size` bytes a float."""
    if files[0].suffix != ".safetensors":  # pickles: only their sizes are cheap to read
        stored = sum(f.stat().st_size for f in files)
        if quantized:
            return None, stored
        params = stored // DTYPE_BYTES.get(str(lm.get("torch_dtype") or lm.get("dtype")), 4)  # unknown: fewest
        return params, params * size
    layers = lm.get("num_hidden_layers") or math.inf
    params = total = 0
    for f in files:
        for name, t in safetensors_header(f).items():
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer and int(layer[1]) >= layers:  # a multi-token prediction layer, which vLLM does not load
                continue
            n = math.prod(t["shape"])
            params += n
            start, end = t["data_offsets"]
            total += end - start if quantized or t["dtype"] not in FLOATS else n * size
    return (None if quantized else params), total


def _params(c: dict) -> int:
    """The parameters of a decoder of the config's fields: embeddings, attention, MLP or experts, norms."""
    if reason := _unmodeled(c):
        raise NotModeled(reason)
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    moe = _moe_layers(c)
    dense = 3 * h * (c.get("intermediate_size_mlp") or c["intermediate_size"])  # gate, up, down
    per_layer = _attention_params(c) + 2 * h  # two norms
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", True) else 2)  # unsaid: tied, the fewer
    return embeddings + layers * per_layer + (layers - moe) * dense + moe * _moe_params(c) + h


def _attention_params(c: dict) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): queries through an optional low rank, keys and values a latent
        rank, rope, nope, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        q_rank = c.get("q_lora_rank")
        q = h * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        return q + h * (rank + rope) + rank + rank * heads * (nope + v) + heads * v * h
    head = _head_dim(c)
    return h * heads * head * 2 + h * _kv_heads(c) * head * 2  # q and o, k and v


def _experts(c: dict) -> int:
    return c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0


def _moe_layers(c: dict) -> int:
    """How many layers hold experts: all, but for DeepSeek's and GLM's first_k_dense_replace and moe_layer_freq,
    Qwen's decoder_sparse_step and mlp_only_layers, Llama 4's interleave_moe_layer_step, or mlp_layer_types."""
    if not _experts(c):
        return 0
    if types := c.get("mlp_layer_types"):
        return sum(t == "sparse" for t in types)
    first, freq = c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
    step = c.get("decoder_sparse_step") or c.get("interleave_moe_layer_step") or 1
    dense = set(c.get("mlp_only_layers") or ())
    return sum(i >= first and i % freq == 0 and (i + 1) % step == 0 and i not in dense
               for i in range(c["num_hidden_layers"]))


def _moe_params(c: dict) -> int:
    """One layer's experts: routed (moe_intermediate_size, or Mixtral's intermediate_size), shared, the router."""
    h, experts = c["hidden_size"], _experts(c)
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    shared = (c.get("n_shared_experts") or 0) * inter + (c.get("shared_expert_intermediate_size") or 0)
    return experts * 3 * h * inter + 3 * h * shared + h * experts


def _kv(c: dict, size: int, tensor_parallel: int) -> tuple[int, int, int]:
    """(bytes per token of the full-attention layers, of the windowed layers, the window) on each GPU."""
    if reason := _unmodeled(c):
        raise NotModeled(reason)
    if c.get("kv_lora_rank"):  # MLA: one latent per token and layer, whole on every GPU
        per_layer = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * size
    else:  # vLLM gives each GPU at least one KV head, replicating them beyond num_key_value_heads GPUs
        per_layer = 2 * max(1, _kv_heads(c) // tensor_parallel) * _head_dim(c) * size
    layers = c["num_hidden_layers"]
    windowed, window = _windowed(c, layers)
    return per_layer * (layers - windowed), per_layer * windowed, window


def _windowed(c: dict, layers: int) -> tuple[int, int]:
    """(layers that keep at most a window of tokens, the window): the smallest window the config gives, so that the
    count errs low; every layer where the config gives a window but not which layers use it."""
    windows = [w for w in (c.get("sliding_window"), c.get("attention_chunk_size")) if w]
    if c.get("use_sliding_window") is False:  # Qwen2's: a sliding_window that no layer uses
        windows = [w for w in windows if w != c.get("sliding_window")]
    types = c.get("layer_types")
    if types:
        windowed = sum(t != "full_attention" for t in types)
    elif c.get("sliding_window_pattern") and c.get("sliding_window"):  # Gemma 3, Cohere2: each nth layer global
        windowed = layers - layers // c["sliding_window_pattern"]
    else:
        windowed = layers if windows else 0
    if windowed and not windows:
        raise NotModeled("windowed layers of no window size")
    return windowed, min(windows, default=0)


def _unmodeled(c: dict) -> str:
    """Why the arithmetic does not model this config's layers ("" where it does)."""
    if c.get("is_encoder_decoder"):
        return "an encoder-decoder"
    if other := sorted(set(c.get("layer_types") or ()) - set(ATTENTION)):
        return f"layers of type {', '.join(map(str, other))}"
    if keys := [k for k in c if any(u in k for u in UNMODELED)]:
        return f"a model with {keys[0]} (layers without one KV cache each)"
    return ""


def _kv_heads(c: dict) -> int:
    return (c.get("num_key_value_heads") or c.get("num_kv_heads") or (1 if c.get("multi_query") else 0)
            or c["num_attention_heads"])


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def _quantization(config: dict) -> str:
    """The quantization method of a quantized checkpoint ("" for none)."""
    for c in (config, config.get("text_config") or {}):
        q = c.get("quantization_config") or c.get("compression_config")
        if q:
            return str(q.get("quant_method") or "quantized") if isinstance(q, dict) else "quantized"
    return ""


def _missing(e: Exception) -> str:
    return f"config.json has no {e.args[0]}" if isinstance(e, KeyError) else f"config.json has a field unread ({e})"


def check_generator(cfg, model_path: str | Path, gpu_bytes: int) -> str:
    """The plan line for this generator's GPU of `gpu_bytes`; ConfigError, with the numbers and what to change, where
    the weights and one sequence of generator.max_model_len do not fit within gpu_memory_utilization, or the weights
    and generator.kv_cache_gb (where set) do not."""
    g, dtype = cfg.generator, cfg.model.dtype
    model_dir, config, name = _model(model_path)
    try:
        fp = footprint(config, dtype, g.tensor_parallel_size, model_dir)
    except NotModeled as e:
        return _unweighed(name, e)
    budget = g.gpu_memory_utilization * gpu_bytes
    sequence = fp.sequence_bytes(g.max_model_len)
    what = f"{fp.params / 1e9:.2f} B parameters" if fp.params is not None else f"{_quantization(config)} checkpoint"
    line = (f"{name} ({what}) in {dtype} needs {fp.weight_bytes / GB:.1f} GB of weights on each of the generator's "
            f"{_gpus(g.tensor_parallel_size)}; with gpu_memory_utilization {g.gpu_memory_utilization:g} of "
            f"{gpu_bytes / GB:.1f} GB ")
    if g.kv_cache_gb:  # vLLM's kv_cache_memory_bytes: the cache is this size, whatever the budget leaves
        left = g.kv_cache_gb * GB
        line += (f"and generator.kv_cache_gb {g.kv_cache_gb:g}, {(budget - fp.weight_bytes - left) / GB:.1f} GB are "
                 f"left for vLLM's activations and CUDA context (about {OVERHEAD_BYTES / GB:.1f} GB)")
        if fp.weight_bytes + left > budget:
            raise ConfigError(f"{line}: the weights and the KV cache exceed gpu_memory_utilization's "
                              f"{budget / GB:.1f} GB. Lower generator.kv_cache_gb or raise "
                              "generator.gpu_memory_utilization")
    else:
        left = budget - fp.weight_bytes - OVERHEAD_BYTES
        line += (f"that leaves {left / GB:.1f} GB of KV cache (after {OVERHEAD_BYTES / GB:.1f} GB for vLLM's "
                 "activations and CUDA context)")
    if fp.kv_unmodeled:
        line += f"; its KV cache is not modeled ({fp.kv_unmodeled}): only the weights are checked"
        if left < 0:
            raise ConfigError(f"{line}: the weights alone do not fit. {_ADVICE}")
        return line
    line += f" for {max(0, int(left // max(sequence, 1)))} sequences of {g.max_model_len} tokens"
    if left < sequence:
        advice = "Raise generator.kv_cache_gb or lower generator.max_model_len" if g.kv_cache_gb else _ADVICE
        raise ConfigError(f"{line}: not one sequence ({sequence / GB:.2f} GB) fits. {advice}")
    return line


def check_learner(cfg, model_path: str | Path, gpu_bytes: int, ranks: int) -> str:
    """The plan line for each learner rank's GPU of `gpu_bytes` (or trainer.gpu_memory_gb, the rank's cap, where set):
    what the weights, gradients and Adam's state (fp32 masters beside bf16 weights) take there under trainer.zero_stage
    and trainer.offload_optimizer; with model.lora, the frozen base (model.quantization: its linear layers quantized)
    and the adapters with their gradients and Adam's state. ConfigError, with the numbers and what to change, where
    they alone do not fit. Activations are not counted (they follow trainer.micro_batch_tokens), nor ZeRO's buffers:
    the figure errs low, so a refusal is never wrong."""
    t, m = cfg.trainer, cfg.model
    model_dir, config, name = _model(model_path)
    if t.gpu_memory_gb:
        gpu_bytes = min(gpu_bytes, int(t.gpu_memory_gb * GB))
    try:
        params = footprint(config, m.dtype, 1, model_dir).params
    except NotModeled as e:
        return _unweighed(name, e)
    if params is None:
        return f"{name}: check skipped for a {_quantization(config)} checkpoint"
    try:
        what, gpu, cpu, advice = _learner_plan(language_model(config), params, cfg, ranks)
    except (NotModeled, KeyError, TypeError) as e:  # model.lora's linear layers
        return f"{name}: check skipped for model.lora ({e if isinstance(e, NotModeled) else _missing(e)})"
    line = (f"{name} ({params / 1e9:.2f} B parameters) in {m.dtype} under ZeRO {t.zero_stage} over {ranks} "
            f"rank{'s' if ranks > 1 else ''}: {gpu / GB:.1f} GB of {what} on each rank's GPU of "
            f"{gpu_bytes / GB:.1f} GB ({'trainer.gpu_memory_gb; ' if t.gpu_memory_gb else ''}activations besides)")
    if cpu:
        line += f", {cpu / GB:.1f} GB of optimizer state in the CPUs' memory"
    if gpu > gpu_bytes:
        more = ", or a larger trainer.gpu_memory_gb" if t.gpu_memory_gb else ""
        raise ConfigError(f"{line}: they do not fit. {advice}{more}")
    return line


def _learner_plan(c: dict, params: int, cfg, ranks: int) -> tuple[str, int, int, str]:
    """(what each rank's GPU holds, in words; its bytes there, and on the CPUs in all; what to change where they do
    not fit) of a learner of `params` parameters, config.json's fields `c`."""
    t, m = cfg.trainer, cfg.model
    size = DTYPE_BYTES[m.dtype]
    if m.lora is None:
        gpu, cpu = learner_bytes(params, size, t.zero_stage, ranks, t.offload_optimizer)
        return "weights, gradients and optimizer state", gpu, cpu, _full_advice(params, size, ranks)
    base, trained = lora_bytes(c, params, m)
    gpu, cpu = learner_bytes(trained, size, t.zero_stage, ranks, t.offload_optimizer)
    frozen = base // ranks if t.zero_stage == 3 else base  # no gradient, no optimizer state
    kind = f"in {m.quantization}; {params * size / GB:.1f} GB in {m.dtype}" if m.quantization else f"in {m.dtype}"
    what = (f"a frozen base ({frozen / GB:.1f} GB {kind}) and LoRA r {m.lora.r} ({trained / 1e6:.1f} M trained "
            f"parameters: {gpu / GB:.2f} GB with their gradients and optimizer state)")
    return what, frozen + gpu, cpu, _lora_advice(c, params, m)


def _full_advice(params: int, size: int, ranks: int) -> str:
    sharded = learner_bytes(params, size, 3, ranks, False)[0]
    offloaded = learner_bytes(params, size, 3, ranks, True)[0]
    return (f"trainer.zero_stage: 3 shards them over the ranks ({sharded / GB:.1f} GB each), with "
            f"trainer.offload_optimizer: true Adam's state and the masters go to the CPU ({offloaded / GB:.1f} GB "
            "each); more ranks, or model.lora (adapters on a frozen base), take less")


def _lora_advice(c: dict, params: int, m) -> str:
    if m.quantization == "4bit":
        return "A GPU with more memory, or a smaller model"
    four = lora_bytes(c, params, dataclasses.replace(m, quantization="4bit"))[0]
    return f"model.quantization: 4bit holds the base in {four / GB:.1f} GB (QLoRA); or a GPU with more memory"


# bytes of one weight of a linear layer quantized by bitsandbytes: NF4's 4 bits and one byte of absmax per block of
# 64 (double quantization; its second level, 4 bytes per 256 blocks, left out); LLM.int8's byte (its row scales left
# out). Both err low.
QUANTIZED_BYTES = {"4bit": 0.5 + 1 / 64, "8bit": 1.0}


def lora_bytes(c: dict, params: int, m) -> tuple[int, int]:
    """(bytes of the frozen base, parameters trained) of model.lora on the decoder of config `c`, `params` parameters
    in all. The base: its decoder layers' linear weights at QUANTIZED_BYTES with model.quantization, the rest (and
    all of it without) in model.dtype. Trained: r x (in + out) for each linear layer the adapters target, and the
    output head or input embedding where modules_to_save names it (other saved modules, small, are left out)."""
    lora, size, layers = m.lora, DTYPE_BYTES[m.dtype], c["num_hidden_layers"]
    linears = _linears(c)
    linear = layers * sum(i * o for i, o in linears.values())
    weight = QUANTIZED_BYTES[m.quantization] if m.quantization else size
    base = int(linear * weight) + max(0, params - linear) * size
    targets = lora.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        raise NotModeled(f"model.lora.target_modules {targets!r} (a regular expression)")
    names = [n for n in linears if targets == "all-linear" or any(t.split(".")[-1] == n for t in targets)]
    adapters = layers * lora.r * sum(sum(linears[n]) for n in names)
    whole = c["vocab_size"] * c["hidden_size"] * sum(s.split(".")[-1] in ("lm_head", "embed_tokens")
                                                     for s in lora.modules_to_save)
    return base, adapters + whole


def _linears(c: dict) -> dict[str, tuple[int, int]]:
    """One decoder layer's linear layers, {name: (in, out)}: those bitsandbytes quantizes and all-linear adapts."""
    reason = _unmodeled(c) or ("a mixture of experts" if _experts(c) else "")
    reason = reason or ("multi-head latent attention" if c.get("kv_lora_rank") else "")
    if reason:
        raise NotModeled(f"{reason}: its linear layers for model.lora")
    h, head = c["hidden_size"], _head_dim(c)
    q, kv = c["num_attention_heads"] * head, _kv_heads(c) * head
    inter = c.get("intermediate_size_mlp") or c["intermediate_size"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def learner_bytes(params: int, size: int, stage: int, ranks: int, offload: bool) -> tuple[int, int]:
    """(bytes on each rank's GPU, bytes on the CPUs in all) of the weights, gradients, fp32 masters (where the weights
    are not fp32) and Adam's two moments of `params` parameters of `size` bytes: ZeRO 1 shards the optimizer's part
    over the ranks, 2 the gradients too, 3 the weights too; offload moves the optimizer's part to the CPU."""
    weights = grads = params * size
    optimizer = params * ((4 if size < 4 else 0) + 8)
    shard = [weights, grads, optimizer]
    for i in range(3 - min(stage, 3), 3):  # stage 1: the optimizer's part; 2: and the gradients; 3: and the weights
        shard[i] //= ranks
    gpu = shard[0] + shard[1] + (0 if offload else shard[2])
    return gpu, (optimizer if offload else 0)


def _model(model_path: str | Path) -> tuple[Path, dict, str]:
    """(its local folder: a hub name's snapshot, which the fingerprints fetched; its config.json; its name)"""
    model_dir = local_dir(str(model_path))
    config = json.loads((model_dir / "config.json").read_text())
    return model_dir, config, Path(str(config.get("_name_or_path") or Path(str(model_path)).name)).name


def _unweighed(name: str, why: NotModeled) -> str:
    return f"{name}: check skipped, neither its weight files nor the arithmetic give its weights ({why})"


_ADVICE = ("Raise generator.gpu_memory_utilization, lower generator.max_model_len, raise "
           "generator.tensor_parallel_size, or use a GPU with more memory")


def _gpus(n: int) -> str:
    return "GPU" if n == 1 else f"{n} GPUs"
