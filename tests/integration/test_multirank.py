"""Two learner ranks (gloo on CPU) with ZeRO-3: batches are split, weights gathered in groups (one all-gather each)."""

from __future__ import annotations

import pytest
import torch

from pipeline.metrics import read_jsonl
from tests.integration.helpers import start_generator, start_learner, wait_steps

pytestmark = pytest.mark.integration


def test_two_rank_zero3_learner(procs, tmp_path, model_cache, free_port):
    run_dir = tmp_path / "zero3"
    steps = 4
    common = [f"trainer.total_steps={steps}", "trainer.ranks=2", "trainer.zero_stage=3"]
    learner = start_learner(procs, run_dir, free_port, common)
    gen = start_generator(procs, run_dir, free_port, common)
    wait_steps(run_dir, steps, 600, [learner, gen])
    assert learner.wait(180) == 0, learner.tail()
    assert gen.wait(60) == 0, gen.tail()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    assert all(r["grad_norm"] > 0 for r in records)
    acks = [e["version"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "weights_applied"]
    assert acks[-1] == steps
    # the gathered final weights are complete (not ZeRO-3 shards) and differ from the initial ones
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.tinymodel import resolve_model_path

    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    initial = load_file(f"{resolve_model_path('builtin:tiny')}/model.safetensors")
    moved = 0.0
    for name, p in final.state_dict().items():
        assert p.shape == initial[name].shape, name
        moved += float((p - initial[name]).abs().sum())
    assert moved > 0
    assert torch.isfinite(torch.tensor(moved))
