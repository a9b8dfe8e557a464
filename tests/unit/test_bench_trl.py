"""The TRL side of bench/vs_trl: it trains what our config trains (LoRA, QLoRA), and the attention that stands in for
the FlashAttention 3 kernel TRL's AsyncGRPOTrainer fetches from the hub keeps each sample of a packed row to its own
root path."""

from __future__ import annotations

import torch

from bench.trl_grpo import tree_mask
from bench.vs_trl_arith import trl_adapters
from pipeline.config import config_from_dict


def test_trl_gets_the_configs_lora_and_its_quantized_base() -> None:
    qlora = config_from_dict({"model": {"path": "builtin:tiny", "lora": {"r": 16, "alpha": 32},
                                        "quantization": "4bit"}})
    lora = config_from_dict({"model": {"path": "builtin:tiny", "lora": {"r": 8, "alpha": 16,
                                                                        "target_modules": ["q_proj", "v_proj"]}}})
    full = config_from_dict({"model": {"path": "builtin:tiny"}})

    assert trl_adapters(qlora.model) == ["--lora", "16,32.0,all-linear", "--quantization", "4bit"]
    assert trl_adapters(lora.model) == ["--lora", "8,16.0,q_proj+v_proj"]
    assert trl_adapters(full.model) == []


def test_a_packed_rows_samples_see_their_shared_prompt_and_not_each_other() -> None:
    # a row: a prompt of 3 tokens (segment 0), then two samples of 2 tokens each (segments 1 and 2)
    cu_q = torch.tensor([0, 3, 5, 7])
    kv_index = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6])  # each segment's root path, in order
    cu_k = torch.tensor([0, 3, 8, 13])

    mask = tree_mask(kv_index, cu_q, cu_k, 7)

    assert mask[5, :3].all() and mask[3, :3].all()  # both samples see the prompt
    assert not mask[5, 3] and not mask[6, 4] and not mask[3, 5]  # neither sees the other
    assert mask[6, 5] and mask[4, 3] and not mask[3, 4]  # causal within a sample
    assert not mask[1, 2] and mask[2, 1]  # and within the prompt
