"""The memory check that refuses, at a generator's start, a GPU that cannot hold the weights and one sequence
(pipeline/memory.py): the arithmetic and the weight files' headers are the check, no GPU needed. The configs are the
public models' config.json fields."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.config import ConfigError, config_from_dict
from pipeline.memory import GB, check_generator, check_learner, footprint, learner_bytes, lora_bytes

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


def _cfg(tmp_path, config=QWEN25_7B, max_model_len=1024, **generator):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return config_from_dict({"model": {"dtype": "bfloat16"},
                             "generator": {"max_model_len": max_model_len, **generator}}), tmp_path


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



def test_a_fixed_kv_cache_is_checked_against_the_budget(tmp_path):
    """generator.kv_cache_gb (vLLM's kv_cache_memory_bytes, which vLLM then takes whatever gpu_memory_utilization
    leaves): the plan counts that cache, and refuses one that the budget cannot hold beside the weights, or that
    holds not one sequence."""
    cfg, path = _cfg(tmp_path, gpu_memory_utilization=0.9, kv_cache_gb=4)
    line = check_generator(cfg, path, 24 * 10**9)
    assert line.endswith("and generator.kv_cache_gb 4, 2.4 GB are left for vLLM's activations and CUDA context "
                         "(about 2.0 GB) for 68 sequences of 1024 tokens")
    cfg, path = _cfg(tmp_path, gpu_memory_utilization=0.9, kv_cache_gb=7)  # 15.2 + 7 > 21.6 GB
    with pytest.raises(ConfigError, match="exceed gpu_memory_utilization's 21.6 GB. Lower generator.kv_cache_gb"):
        check_generator(cfg, path, 24 * 10**9)
    cfg, path = _cfg(tmp_path, gpu_memory_utilization=0.9, kv_cache_gb=0.05)
    with pytest.raises(ConfigError, match=r"not one sequence \(0.06 GB\) fits. Raise generator.kv_cache_gb"):
        check_generator(cfg, path, 24 * 10**9)

QWEN3_30B_A3B = {"_name_or_path": "Qwen/Qwen3-30B-A3B", "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
                 "sliding_window": None, "use_sliding_window": False}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
                    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "vocab_size": 102400, "tie_word_embeddings": False}
QWEN25_15B = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}
MISTRAL_7B_V01 = {"_name_or_path": "mistralai/Mistral-7B-v0.1", "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                  "sliding_window": 4096, "tie_word_embeddings": False}
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},  # the rest are Gemma3TextConfig's defaults
             "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "num_hidden_layers": 27}}


def test_a_mixture_of_experts_counts_every_expert(tmp_path):
    fp = footprint(QWEN3_30B_A3B, "bfloat16")
    assert fp.params == pytest.approx(30.5e9, rel=0.005)  # its model card: 30.5 B in all, 3.3 B active
    assert fp.weight_bytes / GB == pytest.approx(61.1, abs=0.05)
    assert footprint(DEEPSEEK_V2_LITE, "bfloat16").params == pytest.approx(15.7e9, rel=0.005)  # its card: 15.7 B
    cfg, path = _cfg(tmp_path, QWEN3_30B_A3B, gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match=r"Qwen3-30B-A3B \(30.53 B parameters\) in bfloat16 needs 61.1 GB"):
        check_generator(cfg, path, 48 * 10**9)


def test_mla_caches_one_latent_per_token_and_layer_on_every_gpu():
    for tp in (1, 2):
        assert footprint(DEEPSEEK_V2_LITE, "bfloat16", tp).kv_bytes_per_token == 27 * (512 + 64) * 2


def test_kv_heads_fewer_than_the_gpus_are_replicated_one_on_each():
    assert footprint(QWEN25_15B, "bfloat16").kv_bytes_per_token == 2 * 28 * 2 * 128 * 2
    for tp in (2, 4):  # 2 KV heads over 4 GPUs: one head on each, not half of one
        assert footprint(QWEN25_15B, "bfloat16", tp).kv_bytes_per_token == 2 * 28 * 1 * 128 * 2


def test_a_multimodal_wrapper_is_read_through_its_text_config(tmp_path):
    wrapped = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "text_config": QWEN25_7B,
               "vision_config": {"hidden_size": 1280, "depth": 32}}
    assert footprint(wrapped, "bfloat16") == footprint(QWEN25_7B, "bfloat16")
    cfg, path = _cfg(tmp_path, wrapped, gpu_memory_utilization=0.9)
    assert check_generator(cfg, path, 24 * 10**9).endswith("for 74 sequences of 1024 tokens")
    # Gemma 3's text_config leaves the heads to the class defaults: with no weight files nothing is checked, and said
    cfg, path = _cfg(tmp_path, GEMMA3_4B, gpu_memory_utilization=0.9)
    assert "check skipped" in check_generator(cfg, path, 24 * 10**9)
    save_file({"language_model.model.embed_tokens.weight": np.zeros((64, 64), np.float32)},
              str(tmp_path / "model.safetensors"))
    assert check_generator(cfg, path, 24 * 10**9).endswith(
        "its KV cache is not modeled (config.json has no num_attention_heads): only the weights are checked")


def test_the_weight_files_give_the_weights_at_the_runs_dtype(tmp_path):
    cfg, path = _cfg(tmp_path, QWEN25_7B, gpu_memory_utilization=0.7)  # refused above, when the config's 7 B counted
    save_file({"model.embed_tokens.weight": np.zeros((1000, 64), np.float32),
               "model.layers.0.mlp.up_proj.weight": np.zeros((256, 64), np.float32),
               "model.layers.28.eh_proj.weight": np.zeros((64, 64), np.float32)},  # past num_hidden_layers: not loaded
              str(tmp_path / "model-00001-of-00001.safetensors"))
    save_file({"lm_head.weight": np.zeros((1000, 64), np.float32)}, str(tmp_path / "consolidated.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    assert check_generator(cfg, path, 24 * 10**9).startswith(
        "Qwen2.5-7B-Instruct (0.00 B parameters) in bfloat16 needs 0.0 GB of weights")
    fp = footprint(QWEN25_7B, "bfloat16", model_dir=path)
    assert fp.params == 1000 * 64 + 256 * 64 and fp.weight_bytes == fp.params * 2  # float32 files held in bf16


def test_a_quantized_checkpoint_keeps_its_stored_bytes(tmp_path):
    config = {**QWEN25_7B, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    save_file({"model.layers.0.mlp.up_proj.qweight": np.zeros((8, 256), np.int32),
               "model.layers.0.mlp.up_proj.scales": np.zeros((1, 256), np.float16)}, str(tmp_path / "m.safetensors"))
    cfg, path = _cfg(tmp_path, config, gpu_memory_utilization=0.9)
    assert check_generator(cfg, path, 24 * 10**9).startswith(
        "Qwen2.5-7B-Instruct (gptq checkpoint) in bfloat16 needs 0.0 GB of weights")
    fp = footprint(config, "bfloat16", model_dir=tmp_path)
    assert fp.params is None and fp.weight_bytes == 8 * 256 * 4 + 256 * 2  # as stored, not at the run's dtype


def test_sliding_window_layers_keep_only_the_window(tmp_path):
    # 14.5 GB of weights leave 2.7 GB: 4.3 GB for 32768 tokens in every layer, 0.5 GB in a window of 4096
    cfg, path = _cfg(tmp_path, MISTRAL_7B_V01, max_model_len=32768, gpu_memory_utilization=0.8)
    assert check_generator(cfg, path, 24 * 10**9).endswith("for 5 sequences of 32768 tokens")
    fp = footprint(MISTRAL_7B_V01, "bfloat16")
    assert (fp.kv_bytes_per_token, fp.window_kv_bytes_per_token, fp.window) == (0, 2 * 32 * 8 * 128 * 2, 4096)
    gemma = {**QWEN25_7B, "num_hidden_layers": 24, "sliding_window": 1024,
             "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4}
    fp = footprint(gemma, "bfloat16")
    assert fp.kv_bytes_per_token * 5 == fp.window_kv_bytes_per_token and fp.window == 1024


def test_layers_it_does_not_model_are_not_refused_but_said_so(tmp_path):
    hybrid = {**QWEN25_7B, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}  # Qwen3-Next's pattern
    cfg, path = _cfg(tmp_path, hybrid, max_model_len=10**6, gpu_memory_utilization=0.9)
    assert check_generator(cfg, path, 24 * 10**9).endswith(
        "check skipped, neither its weight files nor the arithmetic give its weights (layers of type linear_attention)")
    save_file({"model.embed_tokens.weight": np.zeros((1000, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    assert check_generator(cfg, path, 24 * 10**9).endswith(
        "its KV cache is not modeled (layers of type linear_attention): only the weights are checked")
    with pytest.raises(ConfigError, match="only the weights are checked: the weights alone do not fit"):
        check_generator(cfg, path, 2 * 10**9)  # less than the 2 GB of vLLM's overhead
    jamba = {**QWEN25_7B, "attn_layer_period": 8, "mamba_d_state": 16}
    cfg, path = _cfg(tmp_path, jamba, gpu_memory_utilization=0.9)
    assert "not modeled (a model with attn_layer_period" in check_generator(cfg, path, 24 * 10**9)


def _learner(tmp_path, stage: int, offload: bool = False, **model):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    return config_from_dict({"model": {"dtype": "bfloat16", **model}, "trainer": {
        "zero_stage": stage, "offload_optimizer": offload}}), tmp_path


def test_a_7b_learner_on_24_gb_cards_needs_zero_3_with_the_optimizer_offloaded_and_is_told_so(tmp_path):
    """Full weights of a 7B: 16 bytes a parameter (bf16 weights and gradients, fp32 masters, Adam's two moments). On
    three 24 GB cards ZeRO 3 alone leaves 40.6 GB a GPU (refused, with the way out); its optimizer offloaded, 10.2."""
    cfg, path = _learner(tmp_path, 3)
    with pytest.raises(ConfigError) as e:
        check_learner(cfg, path, 24 * 10**9, 3)
    assert str(e.value).startswith(
        "Qwen2.5-7B-Instruct (7.62 B parameters) in bfloat16 under ZeRO 3 over 3 ranks: 40.6 GB of weights, "
        "gradients and optimizer state on each rank's GPU of 24.0 GB (activations besides): they do not fit. "
        "trainer.zero_stage: 3 shards them over the ranks (40.6 GB each), with trainer.offload_optimizer: true "
        "Adam's state and the masters go to the CPU (10.2 GB each)")
    cfg, path = _learner(tmp_path, 3, offload=True)
    assert check_learner(cfg, path, 24 * 10**9, 3).endswith(
        "10.2 GB of weights, gradients and optimizer state on each rank's GPU of 24.0 GB (activations besides), "
        "91.4 GB of optimizer state in the CPUs' memory")
    with pytest.raises(ConfigError, match="ZeRO 0 over 1 rank: 121.8 GB"):  # one H100 cannot hold it unsharded
        check_learner(*_learner(tmp_path, 0), 80 * 10**9, 1)
    assert "15.6 GB of a frozen base (15.2 GB in bfloat16) and LoRA r 8" in check_learner(
        *_learner(tmp_path, 0, lora={"r": 8}), 24 * 10**9, 1)  # adapters: it fits


def test_each_zero_stage_shards_what_deepspeed_shards():
    p = 10**9
    assert learner_bytes(p, 2, 0, 4, False) == (16 * p, 0)
    assert learner_bytes(p, 2, 1, 4, False) == (4 * p + 12 * p // 4, 0)  # the optimizer's part
    assert learner_bytes(p, 2, 2, 4, False) == (2 * p + 14 * p // 4, 0)  # and the gradients
    assert learner_bytes(p, 2, 3, 4, False) == (16 * p // 4, 0)  # and the weights
    assert learner_bytes(p, 2, 3, 4, True) == (4 * p // 4, 12 * p)
    assert learner_bytes(p, 4, 0, 1, False) == (16 * p, 0)  # fp32: no masters, the weights are


QKVO_GUD = [(3584, 3584), (3584, 512), (3584, 512), (3584, 3584), (3584, 18944), (3584, 18944), (18944, 3584)]


def test_a_4bit_base_needs_about_a_quarter_of_the_bf16_bytes_plus_the_adapter_and_its_optimizer(tmp_path):
    """QLoRA on the Qwen2.5-7B shape (issue 54's setup): the decoder layers' linear weights in NF4 take 4 bits and a
    byte of absmax per 64 (0.26 of their bf16 bytes); the embeddings and the output head stay in bf16 (5.5 GB of
    base in all, against 15.2); LoRA r 16 on every linear layer trains r (in + out) a layer each, 16 bytes a parameter
    with its gradient, fp32 master and Adam's moments."""
    cfg, path = _learner(tmp_path, 0, lora={"r": 16}, quantization="4bit")
    params = footprint(QWEN25_7B, "bfloat16").params
    base, trained = lora_bytes(QWEN25_7B, params, cfg.model)
    linear = 28 * sum(i * o for i, o in QKVO_GUD)
    whole = params - linear  # the embedding, the untied output head, the norms
    assert whole == 2 * 152064 * 3584 + 57 * 3584
    assert 0.25 < (base - 2 * whole) / (2 * linear) < 0.26  # about a quarter of the bf16 bytes
    assert base == int(linear * (0.5 + 1 / 64)) + 2 * whole
    assert trained == 28 * 16 * sum(i + o for i, o in QKVO_GUD) == 40_370_176
    assert check_learner(cfg, path, 42 * 10**9, 1) == (
        "Qwen2.5-7B-Instruct (7.62 B parameters) in bfloat16 under ZeRO 0 over 1 rank: 6.2 GB of a frozen base (5.5 GB "
        "in 4bit; 15.2 GB in bfloat16) and LoRA r 16 (40.4 M trained parameters: 0.65 GB with their gradients and "
        "optimizer state) on each rank's GPU of 42.0 GB (activations besides)")
    assert (base + 16 * trained) / GB == pytest.approx(6.19, abs=0.01)
    cfg, _ = _learner(tmp_path, 0, lora={"r": 16, "target_modules": ["q_proj", "self_attn.v_proj"],
                                         "modules_to_save": ["lm_head"]}, quantization="8bit")
    base, trained = lora_bytes(QWEN25_7B, params, cfg.model)
    assert base == linear + 2 * whole and trained == 28 * 16 * (3584 * 2 + 3584 + 512) + 152064 * 3584


def test_the_learners_cap_is_its_card_and_a_model_past_it_is_refused_with_the_numbers(tmp_path):
    """trainer.gpu_memory_gb: the check counts the cap as the card (an H200's 141 GB held to 40, as on an A100)."""
    h200 = 141 * 10**9
    cfg, path = _learner(tmp_path, 0, lora={"r": 16}, quantization="4bit")
    cfg.trainer.gpu_memory_gb = 40.0
    assert check_learner(cfg, path, h200, 1).endswith("on each rank's GPU of 40.0 GB (trainer.gpu_memory_gb; "
                                                      "activations besides)")
    cfg.trainer.gpu_memory_gb = 5.0
    with pytest.raises(ConfigError) as e:
        check_learner(cfg, path, h200, 1)
    assert str(e.value).endswith(
        "6.2 GB of a frozen base (5.5 GB in 4bit; 15.2 GB in bfloat16) and LoRA r 16 (40.4 M trained parameters: "
        "0.65 GB with their gradients and optimizer state) on each rank's GPU of 5.0 GB (trainer.gpu_memory_gb; "
        "activations besides): they do not fit. A GPU with more memory, or a smaller model, or a larger "
        "trainer.gpu_memory_gb")
    cfg, path = _learner(tmp_path, 0, lora={"r": 16})  # the base in bf16: told what 4bit would take
    cfg.trainer.gpu_memory_gb = 12.0
    with pytest.raises(ConfigError, match=r"15.9 GB of a frozen base \(15.2 GB in bfloat16\).* GPU of 12.0 GB .*: they "
                                          r"do not fit. model.quantization: 4bit holds the base in 5.5 GB \(QLoRA\)"):
        check_learner(cfg, path, h200, 1)
    cfg, path = _learner(tmp_path, 0)  # full weights: 121.8 GB fit the card, not the cap
    assert "121.8 GB of weights" in check_learner(cfg, path, h200, 1)
    cfg.trainer.gpu_memory_gb = 40.0
    with pytest.raises(ConfigError, match=r"121.8 GB .* GPU of 40.0 GB .* or a larger trainer.gpu_memory_gb$"):
        check_learner(cfg, path, h200, 1)


def test_adapters_on_layers_the_arithmetic_does_not_model_are_not_refused_but_said_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    cfg = config_from_dict({"model": {"dtype": "bfloat16", "lora": {"r": 8}}})
    assert check_learner(cfg, tmp_path, 24 * 10**9, 1).endswith(
        "check skipped for model.lora (a mixture of experts: its linear layers for model.lora)")
    cfg, path = _learner(tmp_path, 0, lora={"target_modules": ".*proj"})  # PEFT reads a string as a pattern
    assert check_learner(cfg, path, 24 * 10**9, 1).endswith(
        "check skipped for model.lora (model.lora.target_modules '.*proj' (a regular expression))")


def test_the_learner_caps_its_allocator_and_sizes_what_it_may_still_take_within_the_cap(monkeypatch):
    """learner/model.py on a stand-in H200 (no GPU here): trainer.gpu_memory_gb sets torch's per-process fraction,
    and the room the automatic micro-batch budget and the publisher's buckets count is the cap's, not the card's."""
    import torch

    from learner.model import cap_gpu_memory, free_gpu_bytes

    fraction = {0: 1.0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 10**9, 141 * 10**9))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 30 * 10**9)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 35 * 10**9)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fraction.update({device: f}))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction[0])
    assert cap_gpu_memory(0) == 141 * 10**9 and fraction[0] == 1.0  # no cap: nothing set
    assert free_gpu_bytes() == 105 * 10**9  # free, and what the allocator holds unused
    assert cap_gpu_memory(40) == 141 * 10**9 and fraction[0] == pytest.approx(40 / 141)
    assert free_gpu_bytes() == pytest.approx(10 * 10**9, abs=1)  # 40 GB less the 30 allocated
    assert cap_gpu_memory(200) == 141 * 10**9 and fraction[0] == 1.0  # a cap past the card is the card


def test_lora_adapters_served_in_float32_on_a_gpu_are_refused_before_the_engine(monkeypatch):
    """vLLM's LoRA kernels on GPUs take float16 or bfloat16: generator.lora_mode adapter with model.dtype float32 is
    refused before vLLM loads, naming both knobs (the engine's first forward failed a bare assertion in Triton)."""
    import torch

    from generator.engines import check_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = config_from_dict({"model": {"dtype": "float32", "lora": {"r": 8}}, "generator": {"lora_mode": "adapter"}})
    with pytest.raises(ConfigError, match="model.dtype is float32. Set model.dtype to bfloat16, or generator.lora_"):
        check_memory(cfg, "unused")
