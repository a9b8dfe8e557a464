"""The LoRA learner with the real DeepSpeed engine (CPU, gloo, in process): the base stays bit-identical while the
adapter trains, under ZeRO 0 (MixedAdamW), 2 and 3; a checkpoint holds the adapter and its optimizer state and
not the base, and a new engine resumed from it holds the same adapter; a full-weight run refuses it. The KL
reference of a LoRA run is the base itself (adapters off). The same with the base quantized by bitsandbytes
(model.quantization, QLoRA), whose checkpoint a LoRA run on the unquantized base refuses."""

from __future__ import annotations

import pytest
import torch

from learner import checkpoint
from learner.model import build_engine, init_distributed
from learner.step import train_step
from learner.versions import AdapterVersion
from pipeline.config import config_from_dict
from pipeline.tinymodel import PAD_ID, resolve_model_path
from tests.integration.test_learner_step import _distinct_groups, learner_config

pytestmark = pytest.mark.integration


def _split(engine) -> tuple[dict, dict]:
    import deepspeed

    base, adapter = {}, {}
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=hasattr(params[0][1], "ds_id")):  # ZeRO-3
        for name, p in params:
            (adapter if p.requires_grad else base)[name] = p.detach().clone()
    return base, adapter


@pytest.mark.parametrize("stage,quantization", [(0, None), (2, None), (3, None), (0, "4bit"), (2, "8bit")])
def test_the_adapter_trains_the_base_does_not_and_a_checkpoint_resumes_the_same_adapter(model_cache, tmp_path,
                                                                                         stage, quantization):
    init_distributed()
    cfg = learner_config({"model": {"lora": {"r": 4, "alpha": 8}, "quantization": quantization}, "trainer": {
        "zero_stage": stage, "batch_size": 4, "group_size": 2, "lr": 0.01, "kl_coef": 0.1}})
    path = resolve_model_path("builtin:tiny")
    engine, extras = build_engine(cfg, path)
    base0, adapter0 = _split(engine)
    assert all(".lora_" in n for n in adapter0) and len(adapter0) == 2 * 7 * 2
    integers = [n for n, p in base0.items() if not p.is_floating_point()]  # bitsandbytes' packed weights
    assert len(integers) == (0 if quantization is None else 2 * 7)
    for step in range(2):
        stats = train_step(engine, extras, _distinct_groups(4), cfg, step, PAD_ID)
        assert not stats["skipped"]
    base1, adapter1 = _split(engine)
    assert all(torch.equal(base0[n], base1[n]) for n in base0)  # bit-identical
    assert any(not torch.equal(adapter0[n], adapter1[n]) for n in adapter0)
    assert stats["kl/reference"] > 0  # the adapters moved the policy away from the base, which is the reference

    kind = AdapterVersion(engine.module, quantization).kind
    checkpoint.save(engine, tmp_path, 2, {}, rank=0, what=checkpoint.meaning(cfg, "f", kind))
    states = torch.load(next((tmp_path / "checkpoints" / "v2").glob("*model_states.pt")), weights_only=False)
    saved = states["module"]
    assert saved and all(".lora_" in n for n in saved)  # the adapter alone, not the base

    fresh, fresh_extras = build_engine(cfg, path)
    assert any(not torch.equal(adapter1[n], p) for n, p in fresh.module.named_parameters() if n in adapter1)
    version, _ = checkpoint.load(fresh, tmp_path, kind)
    assert version == 2
    base2, adapter2 = _split(fresh)
    assert all(torch.equal(adapter1[n], adapter2[n]) for n in adapter1)
    assert all(torch.equal(base0[n], base2[n]) for n in base0)
    # the optimizer state came back too: the next step of both is the same
    a = train_step(engine, extras, _distinct_groups(4), cfg, 2, PAD_ID)
    b = train_step(fresh, fresh_extras, _distinct_groups(4), cfg, 2, PAD_ID)
    assert a["loss"] == pytest.approx(b["loss"]) and a["grad_norm"] == pytest.approx(b["grad_norm"])
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(AdapterVersion(engine.module).named(),
                                                            AdapterVersion(fresh.module).named(), strict=True))

    full, _ = build_engine(config_from_dict({"trainer": {"zero_stage": stage}}), path)
    with pytest.raises(checkpoint.CheckpointError, match="holds a LoRA adapter"):
        checkpoint.load(full, tmp_path, "full")
    if quantization is not None:  # trained on the quantized base: a LoRA run on the plain base is another run
        with pytest.raises(checkpoint.CheckpointError, match=f"of an? {quantization[0]}-bit base .* but this "
                                                             "config trains a LoRA adapter"):
            checkpoint.load(fresh, tmp_path, "lora")
    # the adapter is loaded strictly: a checkpoint that lacks one of the model's adapter tensors is refused, where a
    # non-strict load (a LoRA checkpoint holds no base) would leave that tensor at its initial value unnoticed
    states_file = next((tmp_path / "checkpoints" / "v2").glob("*model_states.pt"))
    dropped = sorted(saved)[0]
    torch.save({**states, "module": {k: v for k, v in saved.items() if k != dropped}}, states_file)
    with pytest.raises(checkpoint.CheckpointError, match=r"1 missing, e\.g\. \['" + dropped.replace(".", r"\.")):
        checkpoint.load(build_engine(cfg, path)[0], tmp_path, kind)
