"""The learner step with the real DeepSpeed engine (CPU, gloo, in process): a step whose loss or gradient is not
finite changes nothing, neither the weights nor the optimizer's state, under ZeRO 0 and ZeRO 3; without ZeRO a bf16
model's step is MixedAdamW's (fp32 masters, clipped by the guard's norm), and a checkpoint carries its masters."""

from __future__ import annotations

import math

import pytest
import torch

from learner.model import build_engine, gathered_weights, init_distributed
from learner.step import train_step
from pipeline import protocol as P
from pipeline.config import config_from_dict
from pipeline.tinymodel import PAD_ID, resolve_model_path

pytestmark = pytest.mark.integration


def learner_config(data: dict):
    """The config of these tests' steps: decoupled unless a test names its loss. Their made-up behaviour log-probs
    (-2.0 a token) are far from the tiny model's (about -2.8), so the default m2po would leave every token out (a
    squared log weight near 0.6 against its tau of 0.04) and train nothing."""
    data.setdefault("trainer", {}).setdefault("loss", "decoupled")
    return config_from_dict(data)


def _groups(n: int, reward=None) -> list[P.RolloutGroup]:
    out = []
    for pid in range(n):
        samples = [P.Sample(P.pack_ints([4 + pid % 10, 4, 5]), P.pack_floats([-2.0, -2.0, -2.0]),
                            float(i) if reward is None else reward, [float(i)], "stop", 0, 0) for i in range(2)]
        out.append(P.RolloutGroup(1, "g", pid, 0, P.pack_ints([4, 5, 3]), samples))
    return out


def _distinct_groups(n: int) -> list[P.RolloutGroup]:
    """Groups whose two samples differ (so their advantages do not cancel in the gradient)."""
    out = []
    for pid in range(n):
        samples = [P.Sample(P.pack_ints([4 + (pid + i) % 10, 5 + i, 6 + 2 * i]), P.pack_floats([-2.0, -2.0, -2.0]),
                            float(i), [float(i)], "stop", 0, 0) for i in range(2)]
        out.append(P.RolloutGroup(1, "g", pid, 0, P.pack_ints([4, 5, 3]), samples))
    return out


def _state(engine, extras, stage: int) -> dict:
    weights = {name: t.detach().clone() for name, t in gathered_weights(engine, stage)}
    moments = {i: {k: v.detach().clone() for k, v in s.items() if torch.is_tensor(v)}
               for i, s in enumerate(extras.guard.optimizer.state.values())}
    masters = getattr(extras.guard.optimizer, "masters", [])  # MixedAdamW (ZeRO 0)
    moments["masters"] = {str(i): m.detach().clone() for i, m in enumerate(masters)}
    return {"weights": weights, "moments": moments}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]) and all(
        torch.equal(a["moments"][i][k], b["moments"][i][k]) for i in a["moments"] for k in a["moments"][i])


@pytest.mark.parametrize("stage,dtype,offload", [(0, "float32", False), (0, "bfloat16", False), (3, "float32", False),
                                                (3, "float32", True)])
def test_a_step_that_is_not_finite_changes_nothing(model_cache, stage, dtype, offload):
    init_distributed()
    cfg = learner_config({"model": {"dtype": dtype}, "trainer": {"zero_stage": stage, "batch_size": 4,
                                                                 "group_size": 2, "offload_optimizer": offload}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    assert not train_step(engine, extras, _groups(4), cfg, 0, PAD_ID)["skipped"]  # a normal step: moments exist now
    before = _state(engine, extras, stage)
    stats = train_step(engine, extras, _groups(4, reward=math.nan), cfg, 1, PAD_ID)
    assert stats["skipped"] and not math.isfinite(stats["loss"])
    assert _same(before, _state(engine, extras, stage))  # weights and optimizer state exactly as before
    stats = train_step(engine, extras, _groups(4), cfg, 1, PAD_ID)  # and training goes on
    assert not stats["skipped"] and math.isfinite(stats["loss"])
    after = _state(engine, extras, stage)
    assert not _same(before, after)
    assert all(torch.isfinite(t).all() for t in after["weights"].values())


def test_an_optimizer_offloaded_to_the_cpu_steps_as_the_one_beside_the_weights(model_cache):
    """trainer.offload_optimizer: ZeRO-3 with its optimizer state and masters offloaded, stepped by DeepSpeed's CPU
    Adam, trains the weights ZeRO-3 with torch's AdamW beside them does, step for step (on a CPU machine both are on
    the CPU, but the offload runs its own optimizer, buffers and copies)."""
    init_distributed()
    initial, weights = {}, {}
    for offload in (False, True):
        cfg = learner_config({"model": {"dtype": "float32"}, "trainer": {
            "zero_stage": 3, "offload_optimizer": offload, "batch_size": 4, "group_size": 2, "lr": 1e-3}})
        engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
        initial = {name: t.detach().clone() for name, t in gathered_weights(engine, 3)}
        for step in range(3):
            assert not train_step(engine, extras, _distinct_groups(4), cfg, step, PAD_ID)["skipped"]
        weights[offload] = {name: t.detach().clone() for name, t in gathered_weights(engine, 3)}
        if offload:  # DeepSpeed offloads (its stage 3 optimizer keeps the fp32 partitions for the CPU Adam)
            assert type(extras.guard.optimizer).__name__ == "GuardedCPUAdam" and engine.optimizer.offload_optimizer
    moved = [n for n in initial if not torch.equal(initial[n], weights[True][n])]
    assert len(moved) > len(initial) // 2  # the steps trained
    for name in initial:
        torch.testing.assert_close(weights[True][name], weights[False][name], rtol=1e-5, atol=1e-6)


def test_without_zero_a_bf16_model_steps_fp32_masters_clipped_by_the_guards_norm(model_cache, monkeypatch):
    """ZeRO 0, bf16: the parameters are bf16 and the rotary frequencies stay fp32; the step is AdamW on fp32 masters
    from the gradients clipped to trainer.grad_clip by the finite guard's norm, and the model holds the masters
    rounded to bf16 afterwards."""
    from learner.model import MixedAdamW

    init_distributed()
    cfg = learner_config({"model": {"dtype": "bfloat16"},
                          "trainer": {"batch_size": 4, "group_size": 2, "lr": 0.05, "grad_clip": 0.01}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    opt = extras.guard.optimizer
    assert engine.optimizer is opt and isinstance(opt, MixedAdamW)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    assert {b.dtype for n, b in engine.module.named_buffers() if "inv_freq" in n} == {torch.float32}
    pairs = list(zip(opt.masters, opt.params, strict=True))
    assert all(m.dtype == torch.float32 and torch.equal(m.bfloat16(), p) for m, p in pairs)
    start = [m.detach().clone() for m in opt.masters]
    seen = {}
    step = MixedAdamW.step

    def spy(self, closure=None):
        seen["grads"] = [p.grad.detach().float().clone() for p in self.params]
        seen["norm"] = self.grad_norm.clone()
        return step(self, closure)

    monkeypatch.setattr(MixedAdamW, "step", spy)
    stats = train_step(engine, extras, _distinct_groups(4), cfg, 0, PAD_ID)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen["grads"]]))
    assert float(seen["norm"]) == pytest.approx(float(norm), rel=1e-5) and stats["grad_norm"] == pytest.approx(
        float(norm), rel=1e-5)
    assert float(norm) > 10 * cfg.trainer.grad_clip  # so the clip acts
    want = [s.clone().requires_grad_() for s in start]
    for w, g in zip(want, seen["grads"], strict=True):
        w.grad = g * (cfg.trainer.grad_clip / (float(norm) + 1e-6))
    torch.optim.AdamW(want, lr=0.05, weight_decay=cfg.trainer.weight_decay).step()
    assert all(torch.allclose(m, w, atol=1e-6) for m, w in zip(opt.masters, want, strict=True))
    assert not all(torch.equal(m, s) for m, s in zip(opt.masters, start, strict=True))
    assert all(torch.equal(m.bfloat16(), p) for m, p in zip(opt.masters, opt.params, strict=True))


def test_a_checkpoint_restores_the_fp32_masters(model_cache, tmp_path):
    """Without ZeRO, bf16: a learner resumed from a checkpoint takes the next step exactly as the one that saved it,
    fp32 masters and Adam moments included (the bf16 weights alone would lose what the masters hold below bf16)."""
    from learner import checkpoint

    init_distributed()
    cfg = learner_config({"model": {"dtype": "bfloat16"}, "trainer": {"batch_size": 4, "group_size": 2,
                                                                      "lr": 1e-4}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    train_step(engine, extras, _distinct_groups(4), cfg, 0, PAD_ID)
    checkpoint.save(engine, tmp_path, 1, {}, rank=0)
    resumed, resumed_extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    assert checkpoint.load(resumed, tmp_path)[0] == 1
    assert _same(_state(engine, extras, 0), _state(resumed, resumed_extras, 0))
    for e, x in ((engine, extras), (resumed, resumed_extras)):
        train_step(e, x, _distinct_groups(4), cfg, 1, PAD_ID)
    assert _same(_state(engine, extras, 0), _state(resumed, resumed_extras, 0))
    # a checkpoint of the DeepSpeed wrapper that ran this step before (its state_dict's layout) resumes too
    state = engine.optimizer.state_dict()
    masters = state.pop("masters")
    older = {"cur_scale": 1.0, "optimizer_state_dict": state, "fp32_groups": [masters]}
    again, again_extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    again.optimizer.load_state_dict(older)
    assert all(torch.equal(a, b) for a, b in zip(again.optimizer.masters, engine.optimizer.masters, strict=True))
    assert _same({"weights": {}, "moments": _state(engine, extras, 0)["moments"]},
                 {"weights": {}, "moments": _state(again, again_extras, 0)["moments"]})


def test_compiled_layers_train_as_the_eager_model_does(model_cache):
    """trainer.compile: every decoder layer is compiled in place (the parameter names, which checkpoints and
    published weights carry, stay as they are), and a step moves the weights as the eager model's step does."""
    init_distributed()
    out = {}
    for compiled in (False, True):
        cfg = learner_config({"trainer": {"batch_size": 4, "group_size": 2, "lr": 0.05, "compile": compiled}})
        engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
        start = _state(engine, extras, 0)["weights"]
        stats = train_step(engine, extras, _distinct_groups(4), cfg, 0, PAD_ID)
        layers = [m for m in engine.module.modules() if getattr(m, "_compiled_call_impl", None) is not None]
        out[compiled] = (stats["loss"], stats["grad_norm"]), _state(engine, extras, 0)["weights"], len(layers)
    assert out[False][2] == 0 and out[True][2] == engine.module.config.num_hidden_layers
    (eager_loss, eager, _), (loss, weights, _) = out[False], out[True]
    assert list(weights) == list(eager)
    assert loss == pytest.approx(eager_loss, rel=1e-4)  # loss and gradient norm
    assert not all(torch.allclose(weights[k], start[k], atol=1e-2) for k in start)  # Adam moved them by up to lr
    assert all(torch.allclose(weights[k], eager[k], atol=1e-3) for k in eager)  # and the same way


def test_several_minibatches_measure_each_update_against_the_proximal_policy(model_cache):
    """trainer.minibatches: one optimizer step per part of the batch. With one, decoupled PPO's ratio to the
    proximal policy is 1 and its clip never acts; with four, the later parts are measured against the weights
    before the batch's first update (a no-grad forward), which the earlier updates moved: the clip acts. With a
    learning rate of 0 nothing moves, so the proximal log-probs equal the trained ones and the clip does not act."""
    init_distributed()
    cfg = learner_config({"trainer": {"batch_size": 8, "group_size": 2, "lr": 0.05, "clip_eps": 0.01,
                                      "micro_batch_tokens": 0}})  # 0: sized from GPU memory; on CPU the default
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    one = train_step(engine, extras, _groups(8), cfg, 0, PAD_ID)
    assert one["updates"] == 1 and one["correction/clip_frac"] == 0 and one["learner/micro_batch_tokens"] == 8192
    cfg.trainer.minibatches = 4
    four = train_step(engine, extras, _groups(8), cfg, 1, PAD_ID)
    assert four["updates"] == 4 and four["correction/clip_frac"] > 0.05
    cfg.trainer.lr = 0.0
    still = train_step(engine, extras, _groups(8), cfg, 2, PAD_ID)
    assert still["updates"] == 4 and still["correction/clip_frac"] == 0


def test_m2po_measures_the_first_update_too_and_masks_over_all_its_micro_batches(model_cache, monkeypatch):
    """trainer.loss m2po with one optimizer step per batch: the proximal log-probs of every row are computed before it
    (one no-grad forward more than decoupled), and the step leaves out the tokens M2PO's Algorithm 1 drops over all of
    the update's tokens, across its four micro-batches (trainer.micro_batch_tokens 16: two rows each)."""
    import numpy as np

    import learner.step
    from learner.loss import Knobs, m2po_cutoff

    measured, real = [], learner.step.proximal

    def proximal(engine, rows, *args):
        measured.append(rows)
        real(engine, rows, *args)

    monkeypatch.setattr(learner.step, "proximal", proximal)
    init_distributed()
    cfg = learner_config({"trainer": {"batch_size": 4, "group_size": 2, "micro_batch_tokens": 16, "loss": "m2po",
                                      "m2po_tau": 1.0}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    groups = _distinct_groups(4)
    for g in groups:  # behaviour log-probs far from the model's and near them: (log w)^2 spread over two scales
        for s in g.samples:
            s.logprobs = P.pack_floats([-1.0, -3.5, -6.0])
    stats = train_step(engine, extras, groups, cfg, 0, PAD_ID)
    (rows,) = measured
    assert len(rows) == 8 and stats["updates"] == 1
    log_w = np.concatenate([(r.prox - r.behaviour)[r.mask > 0] for r in rows])
    dropped = np.mean(np.square(log_w) >= m2po_cutoff(log_w, Knobs(m2po_tau=1.0)))
    assert 0 < dropped < 1 and stats["correction/token_masked"] == pytest.approx(dropped)
    cfg.trainer.loss, cfg.trainer.m2po_tau = "decoupled", 0.04
    assert train_step(engine, extras, groups, cfg, 1, PAD_ID)["correction/token_masked"] == 0 and len(measured) == 1


def test_proximal_log_probs_computed_while_waiting_train_the_step_as_computed_in_it(model_cache, monkeypatch):
    """trainer.early_proximal (learner/early.py): the rows of the groups buffered first get their proximal log-probs
    while the learner waits, a full micro-batch at a time (or what waits, once no group came for QUIET_S), and the
    step computes only the rest. m2po's mask and the
    update are those of the step that computed them all; a skipped look leaves nothing for the next step's weights."""
    import numpy as np

    import learner.early
    import learner.step
    from learner.early import QUIET_S, EarlyProximal

    measured, real = [], learner.step.proximal

    def proximal(engine, rows, *args):
        measured.append(len(rows))
        real(engine, rows, *args)

    monkeypatch.setattr(learner.step, "proximal", proximal)
    monkeypatch.setattr(learner.early, "proximal", proximal)
    init_distributed()
    cfg = learner_config({"trainer": {"batch_size": 6, "group_size": 2, "micro_batch_tokens": 24, "loss": "m2po",
                                      "m2po_tau": 1.0, "lr": 0.05}})
    groups = _distinct_groups(6)
    for g in groups:  # behaviour log-probs far from the model's and near them: m2po masks some tokens, not all
        for s in g.samples:
            s.logprobs = P.pack_floats([-1.0, -3.5, -6.0])
    states, stats, now = [], [], [0.0]  # the clock EarlyProximal reads

    def advance(early: EarlyProximal, arrived: list, step: int, budget: int) -> bool:
        """One look of a learner of one rank (learner/service.py `Learner.ahead`): rank 0's news, taken."""
        return early.take(*early.news(arrived, step), step, budget)

    for ahead in (False, True):
        measured.clear()
        engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
        early = EarlyProximal(engine, cfg, PAD_ID, clock=lambda: now[0]) if ahead else None
        if early is not None:
            assert advance(early, groups[:1], 0, 24) is False  # two rows: one micro-batch, not full; more may join
            while advance(early, groups[:4], 0, 24):  # four groups arrived: eight rows of 8 tokens, three a micro-batch
                pass
            assert len(early.done) == 6 and measured == [3, 3]
            now[0] = QUIET_S  # no group came for that long: the two rows left are computed all the same
            assert advance(early, groups[:4], 0, 24) and not advance(early, groups[:4], 0, 24)
            assert len(early.done) == 8 and measured == [3, 3, 2]
        measured.clear()
        stats.append(train_step(engine, extras, groups, cfg, 0, PAD_ID, early=early))
        states.append(_state(engine, extras, 0))
        if early is not None:
            assert measured == [4] and stats[-1]["learner/early_rows"] == 8  # the step computed the other four
            advance(early, groups, 0, 24)  # computed at version 0's weights: of no use to step 1
            rows = learner.step.build_rows(groups, 1, True)[0]
            assert early.fill(rows, 1) == 0 and all(r.prox is None for r in rows)
    without, with_early = stats
    assert 0 < with_early["correction/token_masked"] < 1
    assert with_early["correction/token_masked"] == pytest.approx(without["correction/token_masked"])
    assert with_early["loss"] == pytest.approx(without["loss"], rel=1e-5)
    for name, w in states[0]["weights"].items():
        np.testing.assert_allclose(states[1]["weights"][name].numpy(), w.numpy(), rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(w, states[1]["weights"][n]) for n, w in _state(*build_engine(
        cfg, resolve_model_path("builtin:tiny")), 0)["weights"].items())  # and the step moved the weights


def test_the_kl_penalty_measures_the_distance_to_the_frozen_initial_model(model_cache):
    init_distributed()
    cfg = learner_config({"trainer": {"batch_size": 4, "group_size": 2, "lr": 0.05, "kl_coef": 0.1}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    first = train_step(engine, extras, _groups(4), cfg, 0, PAD_ID)
    assert first["kl/reference"] < 1e-6  # the weights are still the initial ones
    later = [train_step(engine, extras, _groups(4), cfg, step, PAD_ID)["kl/reference"] for step in (1, 2)]
    assert later[-1] > 1e-4


def test_completion_logprobs_match_the_log_softmax_of_the_whole_logits(model_cache):
    """The step asks the model for logits from the first position that predicts a completion token only
    (`logits_to_keep`); its log-probs at every trained token equal those of the whole logits, for rows whose prompts
    differ in length."""
    from learner.batching import build_rows, collate
    from learner.logprobs import _keeps_logits, forward_logprobs

    init_distributed()
    cfg = learner_config({"trainer": {"batch_size": 2, "group_size": 2}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    groups = _groups(2)
    groups[1].prompt_ids = P.pack_ints([4, 5, 3, 6, 7, 8])
    batch = collate(build_rows(groups, 0, True)[0], PAD_ID, engine.device)
    assert batch["first"] == 2 and _keeps_logits(engine)
    with torch.no_grad():
        logp, logits = forward_logprobs(engine, batch)
        whole = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    want = torch.log_softmax(whole, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    assert logits.shape[1] == batch["input_ids"].shape[1] - 2  # no logits for the prompts' first positions
    mask = batch["mask"] > 0
    assert mask.sum() == 12 and torch.allclose(logp[mask], want[mask], atol=1e-5)


def test_running_out_of_gpu_memory_names_the_micro_batch_budget(model_cache, monkeypatch):
    """A micro-batch that does not fit ends the step with an error that says which setting to lower."""
    import learner.step

    init_distributed()
    cfg = learner_config({"trainer": {"batch_size": 4, "group_size": 2, "micro_batch_tokens": 512}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))

    def oom(model, batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 11.56 GiB")

    monkeypatch.setattr(learner.step, "forward_logprobs", oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"up to 512 tokens \(trainer.micro_batch_tokens=512\): lower it"):
        train_step(engine, extras, _groups(4), cfg, 0, PAD_ID)


def test_the_steps_health_costs_grow_with_the_lags_present_not_with_k(model_cache, monkeypatch):
    """A user's "no limit" (trainer.max_staleness 10**6) sizes nothing: the health metrics hold one slot per lag
    present in the batch (here lags 0 and 2, at step 2)."""
    import learner.step
    from learner.health import StepHealth

    sizes = []

    class Spy(StepHealth):
        def __init__(self, max_lag):
            sizes.append(max_lag)
            super().__init__(max_lag)

    monkeypatch.setattr(learner.step, "StepHealth", Spy)
    init_distributed()
    cfg = learner_config({"trainer": {"batch_size": 4, "group_size": 2, "max_staleness": 10**6}})
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    groups = _distinct_groups(4)
    for s in groups[0].samples:
        s.first_version = s.last_version = 2
    stats = train_step(engine, extras, groups, cfg, 2, PAD_ID)
    assert sizes == [2] and {"mismatch/kl_lag0", "mismatch/kl_lag2"} <= set(stats)
