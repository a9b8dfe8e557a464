"""The learner's model trains in training mode (CPU, the real DeepSpeed engine): `trainer.gradient_checkpointing`
recomputes every decoder layer in the backward. It was accepted and did nothing while the model stayed in the eval
mode from_pretrained leaves it in (found 2026-11-29: the GPU-bound workload trained 5.50 s a step with checkpointing
"on" and 5.46 s with it off). The base's dropout stays off in training mode, and `model.lora.dropout` still acts."""

from __future__ import annotations

import pytest
import torch

from learner.model import build_engine, init_distributed
from learner.step import train_step
from pipeline.tinymodel import PAD_ID, resolve_model_path
from tests.integration.test_learner_step import _distinct_groups, learner_config

pytestmark = pytest.mark.integration


def _step(trainer: dict, model: dict | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """Calls of the first decoder layer during one training step, and the trainable weights after it."""
    init_distributed()
    torch.manual_seed(0)
    cfg = learner_config({"model": model or {}, "trainer": {"batch_size": 4, "group_size": 2, "lr": 0.01,
                                                            **trainer}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    layer = next(m for m in engine.module.modules() if type(m).__name__ in engine.module._no_split_modules)
    calls = []
    # a pre-hook: the recompute stops early, once it has what the backward needs, before a forward hook would run
    layer.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    assert not train_step(engine, extras, _distinct_groups(4), cfg, 0, PAD_ID)["skipped"]
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    return sum(calls), weights


@pytest.mark.parametrize("compiled", [False, True])
def test_gradient_checkpointing_recomputes_each_layer_and_trains_the_same_step(model_cache, compiled):
    plain, plain_weights = _step({"gradient_checkpointing": False})
    checkpointed, weights = _step({"gradient_checkpointing": True, "compile": compiled})

    assert plain >= 1 and checkpointed == 2 * plain  # every forward with a graph runs again in the backward
    assert all(torch.allclose(weights[n], plain_weights[n], atol=1e-4 if compiled else 1e-6)
               for n in weights)  # compiled kernels round as eager ones do not (1.6e-5 apart here)


def test_the_adapters_dropout_acts(model_cache):
    _, plain = _step({}, {"lora": {"r": 4, "alpha": 8}})
    _, dropped = _step({}, {"lora": {"r": 4, "alpha": 8, "dropout": 0.5}})

    change = max((dropped[n] - plain[n]).abs().max().item() for n in plain)
    assert change > 1e-3, change  # the same seed, another gradient


def test_the_base_model_trains_without_dropout(model_cache):
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.model import quiet_dropout

    config = AutoConfig.from_pretrained(resolve_model_path("builtin:tiny"))
    config.attention_dropout = 0.5
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout on, as the config asks

    quiet_dropout(model)

    assert model.training and torch.equal(model(ids).logits, model(ids).logits)
    assert model.config.attention_dropout == 0.5  # what the final model is saved with stays the base's


def test_a_compiled_learner_compiles_its_step_before_the_first_batch_and_trains_the_same(model_cache):
    """trainer.compile: `warm_up` compiles the step's graphs while the first batch is generated (a cold H200 compiled
    SmolLM2's for 28 s after waiting 80 s for its batch). It makes no weight's gradient and moves no weight: the first
    step then compiles nothing and trains as it would have."""
    from torch._dynamo.utils import counters

    from learner.step import warm_up

    init_distributed()
    weights = []
    for warm in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        cfg = learner_config({"trainer": {"batch_size": 4, "group_size": 2, "lr": 0.01, "compile": True}})
        engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if warm:
            assert warm_up(engine, cfg, PAD_ID)
            assert all(p.grad is None and torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
            assert counters["stats"]["unique_graphs"] == 2  # one with gradients, one without
            compiled = {k: dict(counters[k]) for k in ("stats", "aot_autograd", "inductor")}  # the backward's too
        assert not train_step(engine, extras, _distinct_groups(4), cfg, 0, PAD_ID)["skipped"]
        if warm:
            assert {k: dict(counters[k]) for k in compiled} == compiled  # the first step compiled nothing
        weights.append({n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad})
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
