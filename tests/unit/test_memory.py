"""The memory check that refuses, at a generator's start, a GPU that cannot hold the weights and one sequence
(pipeline/memory.py): the arithmetic is the check, no GPU needed."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError, config_from_dict
from pipeline.memory import GB, check_generator, footprint

QWEN25_7B = {"_name_or_path": "Qwen/Qwen2.5-7B-Instruct", "hidden_size": 3584, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
             "tie_word_embeddings": False}
SMOLLM2_135M = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}


def test_the_parameter_counts_of_known_models():
    assert footprint(QWEN25_7B, "bfloat16").params == pytest.approx(7.62e9, rel=0.005)  # its model card: 7.61 B
    assert footprint(SMOLLM2_135M, "float32").params == pytest.approx(134.5e6, rel=0.005)
    fp = footprint(QWEN25_7B, "bfloat16", tensor_parallel=2)
    assert fp.weight_bytes / GB == pytest.approx(7.6, abs=0.05) and fp.kv_bytes_per_token == 28 * 4 * 128 * 2


def _cfg(tmp_path, **generator):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    return config_from_dict({"model": {"dtype": "bfloat16"},
                             "generator": {"max_model_len": 1024, **generator}}), tmp_path


def test_a_24_gb_card_that_cannot_hold_a_7b_is_refused_with_the_numbers(tmp_path):
    cfg, path = _cfg(tmp_path, gpu_memory_utilization=0.7)
    with pytest.raises(ConfigError) as e:
        check_generator(cfg, path, 24 * 10**9)
    assert str(e.value).startswith(
        "Qwen2.5-7B-Instruct (7.62 B parameters) in bfloat16 needs 15.2 GB of weights on each of the generator's GPU; "
        "with gpu_memory_utilization 0.7 of 24.0 GB that leaves -0.4 GB of KV cache")
    assert "not one sequence (0.06 GB) fits. Raise generator.gpu_memory_utilization" in str(e.value)


def test_where_it_fits_the_plan_says_how_many_sequences(tmp_path):
    cfg, path = _cfg(tmp_path, gpu_memory_utilization=0.9)
    line = check_generator(cfg, path, 24 * 10**9)
    assert line.endswith("that leaves 4.4 GB of KV cache (after 2.0 GB for vLLM's activations and CUDA context) for "
                         "74 sequences of 1024 tokens")
    cfg, path = _cfg(tmp_path, gpu_memory_utilization=0.7, tensor_parallel_size=2)  # half the weights on each GPU
    assert "7.6 GB of weights on each of the generator's 2 GPUs" in check_generator(cfg, path, 24 * 10**9)
