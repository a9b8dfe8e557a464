"""What a generator's model takes of its GPU, worked out from the model's config.json before vLLM loads anything.

vLLM sizes its KV cache last: `gpu_memory_utilization` of the GPU's memory, less the weights, less what its
profiling run peaks at; a card too small fails there, minutes after the start, with "no memory available for the
cache blocks" or a KV-cache allocation error (TRL's users of 24 GB cards know it). `check_generator` refuses such a
config at the generator's start with the numbers, and gives the same line as the plan where it fits:

    Qwen2.5-7B-Instruct (7.62 B parameters) in bfloat16 needs 15.2 GB of weights on each of the generator's GPU;
    with gpu_memory_utilization 0.9 of 24.0 GB that leaves 4.4 GB of KV cache (after 2.0 GB for vLLM's activations
    and CUDA context) for 74 sequences of 1024 tokens

The parameter count is that of a decoder of the Llama family (Llama, Qwen2, Mistral, SmolLM2: embeddings, attention
with grouped KV heads, a gated MLP, norms); the KV cache per token is 2 x layers x KV heads x head size x bytes, each
split over tensor_parallel_size. The overhead is an estimate, not vLLM's measure: the check refuses only where even one
sequence of generator.max_model_len does not fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ConfigError

GB = 1e9
OVERHEAD_BYTES = int(2 * GB)  # vLLM's profiled activations, CUDA graphs and the CUDA context, estimated
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Footprint:
    params: int  # the whole model's
    weight_bytes: int  # on each GPU of the tensor-parallel group
    kv_bytes_per_token: int  # on each GPU


def footprint(config: dict, dtype: str, tensor_parallel: int = 1) -> Footprint:
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    attention = h * heads * head * 2 + h * kv_heads * head * 2  # q and o, k and v
    per_layer = attention + 3 * h * inter + 2 * h  # a gated MLP (gate, up, down), two norms
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings", False) else 2)
    params = embeddings + layers * per_layer + h
    size = DTYPE_BYTES[dtype]
    return Footprint(params, params * size // tensor_parallel, 2 * layers * kv_heads * head * size // tensor_parallel)


def check_generator(cfg, model_path: str | Path, gpu_bytes: int) -> str:
    """The plan line for this generator's GPU of `gpu_bytes`; ConfigError, with the numbers and what to change, where
    the weights and one sequence of generator.max_model_len do not fit within gpu_memory_utilization."""
    g = cfg.generator
    config = json.loads((Path(model_path) / "config.json").read_text())
    fp = footprint(config, cfg.model.dtype, g.tensor_parallel_size)
    budget = g.gpu_memory_utilization * gpu_bytes
    left = budget - fp.weight_bytes - OVERHEAD_BYTES
    sequence = fp.kv_bytes_per_token * g.max_model_len
    name = config.get("_name_or_path") or Path(model_path).name
    line = (f"{Path(str(name)).name} ({fp.params / 1e9:.2f} B parameters) in {cfg.model.dtype} needs "
            f"{fp.weight_bytes / GB:.1f} GB of weights on each of the generator's {_gpus(g.tensor_parallel_size)}; "
            f"with gpu_memory_utilization {g.gpu_memory_utilization:g} of {gpu_bytes / GB:.1f} GB that leaves "
            f"{left / GB:.1f} GB of KV cache (after {OVERHEAD_BYTES / GB:.1f} GB for vLLM's activations and CUDA "
            f"context) for {max(0, int(left // sequence))} sequences of {g.max_model_len} tokens")
    if left < sequence:
        raise ConfigError(f"{line}: not one sequence ({sequence / GB:.2f} GB) fits. Raise "
                          "generator.gpu_memory_utilization, lower generator.max_model_len, raise "
                          "generator.tensor_parallel_size, or use a GPU with more memory")
    return line


def _gpus(n: int) -> str:
    return "GPU" if n == 1 else f"{n} GPUs"
