"""The learner step on one GPU (DeepSpeed, no vLLM): micro-batches sized from the free memory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def test_micro_batches_sized_from_free_memory_grow_after_the_first_step(model_cache):
    """trainer.micro_batch_tokens 0: the first step runs at AUTO_FIRST_TOKENS and measures the bytes per token its
    largest micro-batch took; the next step's budget is what fits in the free memory at that rate, and every step
    trains."""
    from learner.model import build_engine, gathered_weights, init_distributed
    from learner.step import AUTO_FIRST_TOKENS, train_step
    from pipeline.config import config_from_dict
    from pipeline.tinymodel import PAD_ID, resolve_model_path
    from tests.integration.test_learner_step import _groups

    init_distributed()
    cfg = config_from_dict({"trainer": {"batch_size": 8, "group_size": 2, "lr": 0.05, "micro_batch_tokens": 0}})
    engine = build_engine(cfg, resolve_model_path("builtin:tiny"))
    before = {n: t.clone() for n, t in gathered_weights(engine, 0)}
    first = train_step(engine, _groups(8), cfg, 0, PAD_ID)
    assert first["learner/micro_batch_tokens"] == AUTO_FIRST_TOKENS and engine.bytes_per_token > 0
    assert first["learner/peak_gpu_gib"] > 0
    free = torch.cuda.mem_get_info()[0]
    second = train_step(engine, _groups(8), cfg, 1, PAD_ID)
    assert second["learner/micro_batch_tokens"] >= 0.5 * free / engine.bytes_per_token > AUTO_FIRST_TOKENS
    assert not first["skipped"] and not second["skipped"]
    assert any(not torch.equal(before[n], t) for n, t in gathered_weights(engine, 0))
