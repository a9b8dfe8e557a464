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
    trains (on groups whose two samples differ, under tis: m2po, the trainer's default, masks every token of these
    made-up samples, whose behaviour log-probs are far from the model's, and two like samples' advantages cancel)."""
    from learner.model import build_engine, gathered_weights, init_distributed
    from learner.step import AUTO_FIRST_TOKENS, train_step
    from pipeline.config import config_from_dict
    from pipeline.tinymodel import PAD_ID, resolve_model_path
    from tests.integration.test_learner_step import _distinct_groups

    init_distributed()
    cfg = config_from_dict({"trainer": {"batch_size": 8, "group_size": 2, "lr": 0.05, "micro_batch_tokens": 0,
                                       "loss": "tis"}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    before = {n: t.clone() for n, t in gathered_weights(engine, 0)}
    first = train_step(engine, extras, _distinct_groups(8), cfg, 0, PAD_ID)
    assert first["learner/micro_batch_tokens"] == AUTO_FIRST_TOKENS and extras.bytes_per_token > 0
    assert first["learner/peak_gpu_gib"] > 0
    free = torch.cuda.mem_get_info()[0]
    second = train_step(engine, extras, _distinct_groups(8), cfg, 1, PAD_ID)
    assert second["learner/micro_batch_tokens"] >= 0.5 * free / extras.bytes_per_token > AUTO_FIRST_TOKENS
    assert not first["skipped"] and not second["skipped"]
    assert any(not torch.equal(before[n], t) for n, t in gathered_weights(engine, 0))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("temperatures", [[1.0, 0.5, 2.0], None])
@pytest.mark.parametrize("vocab", [5000, 300])  # over two blocks; less than one (the tiny model's)
def test_the_log_prob_kernels_match_autograd_of_the_log_softmax(temperatures, in_place, vocab):
    """On a GPU the log-prob passes are Triton kernels (learner/kernels.py): the log-probs and the gradient equal
    autograd's through the fp32 log-softmax within a bf16 rounding, for a vocabulary that is no multiple of the
    kernels' blocks or smaller than one, and logits that are a slice of a longer tensor (a model without
    `logits_to_keep`); positions outside the targets get no gradient, and in place the logits hold their gradient
    afterwards."""
    from learner import logprobs

    torch.manual_seed(0)
    leaf = (torch.randn(3, 9, vocab, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
    logits = (leaf * 1)[:, 2:]  # 7 positions, strided as a slice
    assert logprobs._on_gpu(logits)
    targets = torch.randint(0, vocab, (3, 6), device="cuda")
    temperature = None if temperatures is None else torch.tensor(temperatures, device="cuda").view(3, 1, 1)
    weights = torch.randn(3, 6, device="cuda")
    got = logprobs.token_logprobs(logits, targets, temperature, in_place)
    (got * weights).sum().backward()
    ours, leaf.grad = leaf.grad, None
    scaled = leaf[:, 2:8].float() if temperature is None else leaf[:, 2:8].float() / temperature
    want = torch.log_softmax(scaled, -1).gather(-1, targets[..., None]).squeeze(-1)
    (want * weights).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)
    assert ours.dtype == torch.bfloat16 and not ours[:, :2].any() and not ours[:, 8].any()
    assert torch.allclose(ours.float(), leaf.grad.float(), rtol=2**-7, atol=1e-6)
    assert torch.equal(logits.detach(), ours[:, 2:]) == in_place
