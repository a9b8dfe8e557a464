"""The GRPO advantages and losses against values computed by hand."""

import math

import numpy as np
import pytest
import torch

from learner.batching import Row, build_rows, collate, micro_batches
from learner.logprobs import token_logprobs
from learner.loss import group_advantages, token_loss
from pipeline import protocol as P


def test_group_advantages_by_hand():
    adv, zero = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]]))
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    assert adv[0].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert adv[1].tolist() == [0.0] * 4 and zero.tolist() == [False, True]
    unscaled, _ = group_advantages(torch.tensor([[1.0, 0.0]]), scale=False)
    assert unscaled[0].tolist() == [0.5, -0.5]


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_ppo_clips_against_behaviour():
    logp = torch.log(_t(0.5, 0.5)).requires_grad_()
    loss, _ = token_loss(logp, torch.log(_t(0.25, 0.25)), _t(1.0, -1.0), "ppo", clip_eps=0.2)
    # ratio 2: A=+1 -> -min(2, 1.2) = -1.2 (clipped, no gradient); A=-1 -> -min(-2, -1.2) = 2 (gradient -r*A = 2)
    assert loss.tolist() == pytest.approx([-1.2, 2.0])
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 2.0])


def test_truncated_importance_sampling():
    logp = torch.log(_t(0.5, 0.5)).requires_grad_()
    loss, stats = token_loss(logp, torch.log(_t(0.4, 0.1)), _t(1.0, 1.0), "tis", is_cap=2.0)
    # weights exp(logp - mu) = 1.25 and min(5, 2) = 2; value -w*A, gradient -w*A
    assert loss.tolist() == pytest.approx([-1.25, -2.0])
    assert stats["is_weight"].tolist() == pytest.approx([1.25, 2.0])
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.25, -2.0])


def test_decoupled_ppo_with_a_proximal_policy():
    logp = torch.log(_t(0.6, 0.6)).requires_grad_()
    prox, mu = torch.log(_t(0.4, 0.4)), torch.log(_t(0.2, 0.2))
    loss, _ = token_loss(logp, mu, _t(1.0, -1.0), "decoupled", clip_eps=0.2, is_cap=2.0, prox=prox)
    # w = min(0.4/0.2, 2) = 2, r = 0.6/0.4 = 1.5: A=+1 -> -2*min(1.5, 1.2) = -2.4; A=-1 -> -2*min(-1.5, -1.2) = 3
    assert loss.tolist() == pytest.approx([-2.4, 3.0])
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 3.0])  # d/dlogp of -w*r*A = -w*r*A


def test_decoupled_defaults_to_the_weights_before_the_update():
    logp = torch.log(_t(0.5)).requires_grad_()
    loss, _ = token_loss(logp, torch.log(_t(0.4)), _t(2.0), "decoupled", is_cap=3.0)
    assert loss.item() == pytest.approx(-1.25 * 2.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-2.5)


def test_none_ignores_the_behaviour_policy():
    """none: the stale sample is trained as if the current weights had sampled it: whatever mu says, the value and
    gradient are PPO's against the proximal policy (with one update per batch: the plain policy gradient -A dlogp)."""
    logp = torch.log(_t(0.5, 0.5)).requires_grad_()
    for mu in (torch.log(_t(0.25, 0.25)), torch.log(_t(0.9, 0.01))):
        loss, stats = token_loss(logp, mu, _t(1.0, -1.0), "none", clip_eps=0.2)
        assert loss.tolist() == pytest.approx([-1.0, 1.0]) and stats["is_weight"].tolist() == [1.0, 1.0]
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert grad.tolist() == pytest.approx([-1.0, 1.0])
    prox = torch.log(_t(0.25, 0.25))  # a later update of several: r = 2, clipped against the proximal policy
    loss, _ = token_loss(logp, torch.log(_t(0.9, 0.9)), _t(1.0, -1.0), "none", clip_eps=0.2, prox=prox)
    assert loss.tolist() == pytest.approx([-1.2, 2.0])


def test_unknown_variant():
    with pytest.raises(ValueError, match="trainer.loss"):
        token_loss(_t(0.0), _t(0.0), _t(1.0), "reinforce")


def _sample(tokens, lps, reward, first=0):
    return P.Sample(P.pack_ints(tokens), P.pack_floats(lps), reward, [reward], "stop", first, first)


def test_rows_skip_zero_variance_groups_and_align_tokens():
    good = P.RolloutGroup(1, "g", 0, 0, P.pack_ints([3, 4]), [_sample([5, 6], [-1, -2], 1.0, first=2),
                                                                 _sample([7], [-3], 0.0, first=1)])
    flat = P.RolloutGroup(1, "g", 1, 0, P.pack_ints([3]), [_sample([5], [-1], 0.5), _sample([6], [-1], 0.5)])
    rows, stats = build_rows([good, flat], step=3, scale_rewards=False)
    assert len(rows) == 2 and stats["groups/zero_variance"] == 1
    assert stats["staleness/max_lag"] == 3 and stats["staleness/min_behaviour_version"] == 0
    batch = collate(rows, pad_id=0, device="cpu")
    r = [i for i, row in enumerate(rows) if len(row.completion) == 2][0]
    # prompt [3, 4], completion [5, 6]: tokens 5 and 6 are predicted at positions 1 and 2; the micro-batch is padded
    # to 8 tokens (a multiple of 8, one padded position at least: learner.batching.padded), the padding masked out
    assert batch["input_ids"].shape == (2, 8) and batch["attention_mask"][r].tolist() == [1] * 4 + [0] * 4
    assert batch["mask"][r].tolist() == [0, 1, 1] + [0] * 4
    assert batch["mu"][r].tolist() == [0, -1, -2] + [0] * 4
    assert batch["adv"][r].tolist() == [0, 0.5, 0.5] + [0] * 4


def test_the_loss_covers_the_models_tokens_only_not_the_environments():
    """A two-turn sample: the model's 5, a tool's reply 9 8 (mask 0, log-prob 0), the model's 6."""
    sample = _sample([5, 9, 8, 6], [-1, 0, 0, -2], 1.0)
    sample.mask = P.pack_mask([1, 0, 0, 1])
    group = P.RolloutGroup(1, "g", 0, 0, P.pack_ints([3, 4]), [sample, _sample([7], [-3], 0.0)])
    P.check_shape(group, 2)
    rows, _ = build_rows([group], step=0, scale_rewards=False)
    batch = collate(rows, pad_id=0, device="cpu")
    r = [i for i, row in enumerate(rows) if len(row.completion) == 4][0]
    # predicting 5 and 6 is trained; the tool's tokens are not, nor the padding to 8 tokens
    assert batch["mask"][r].tolist() == [0, 1, 0, 0, 1, 0, 0]
    assert batch["mu"][r].tolist() == [0, -1, 0, 0, -2, 0, 0]
    sample.mask = P.pack_mask([1, 0, 1])  # not one per token
    with pytest.raises(P.ProtocolError, match="mask: 3 bytes for 4 tokens"):
        P.check_shape(group, 2)


def test_token_logprobs_match_a_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 6)
    ids = torch.tensor([[1, 2, 3, 4]])
    got = token_logprobs(logits, ids[:, 1:], torch.tensor([[[2.0]]]))
    want = [math.log(torch.softmax(logits[0, t] / 2.0, -1)[ids[0, t + 1]].item()) for t in range(3)]
    assert got[0].tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("temperatures", [[1.0, 0.5, 2.0], None])
@pytest.mark.parametrize("chunk", [2**27, 7, 30])  # one block; one row in position blocks; several rows a block
def test_token_logprobs_backward_matches_autograd_of_the_log_softmax(monkeypatch, chunk, temperatures, in_place):
    """learner.logprobs computes the log-softmax's gradient itself, block by block from the saved logits: it must
    equal autograd's through the whole fp32 log-softmax, and the positions past the targets get no gradient. In
    place, the logits' own storage holds that gradient afterwards (no second logits-sized tensor)."""
    from learner import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    leaf = torch.randn(3, 6, 5, dtype=torch.bfloat16).requires_grad_()
    logits = leaf * 1  # as a model's output: not a leaf
    targets = torch.randint(0, 5, (3, 5))
    temperature = None if temperatures is None else torch.tensor(temperatures).view(3, 1, 1)
    weights = torch.randn(3, 5)
    got = token_logprobs(logits, targets, temperature, in_place)
    (got * weights).sum().backward()
    ours, leaf.grad = leaf.grad, None
    scaled = leaf[:, :5].float() if temperature is None else leaf[:, :5].float() / temperature
    want = torch.log_softmax(scaled, -1).gather(-1, targets[..., None]).squeeze(-1)
    (want * weights).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6)
    assert ours.dtype == torch.bfloat16 and not ours[:, 5].any()
    assert torch.equal(ours, leaf.grad)
    assert torch.equal(logits.detach(), ours) == in_place


def test_micro_batches_respect_the_token_budget():
    rows = [Row(np.zeros(n, np.int32), np.zeros(2, np.int32), np.zeros(2, np.float32), np.ones(2, np.uint8), 0.0, 1.0)
            for n in range(1, 9)]
    batches = micro_batches(rows, token_budget=20)
    assert sum(len(b) for b in batches) == 8
    assert all(len(b) * max(r.length for r in b) <= 20 for b in batches)


def test_a_lone_row_is_trained_beside_a_masked_copy_where_two_fit():
    """trainer.compile's layers are compiled for two rows and more: a micro-batch of one row gets a copy of it with
    its mask off (nothing trained twice), unless two rows would pass the budget."""
    from learner.step import _micro_batches

    def row(n):
        return Row(np.arange(n, dtype=np.int32), np.ones(3, np.int32), np.zeros(3, np.float32), np.ones(3, np.uint8),
                   1.0, 1.0, 1)

    rows = [row(4), row(4), row(20)]  # 24 tokens pad to 32: the long row is alone in every budget below 64
    got = [(b["input_ids"].shape[0], b["mask"].sum(1).tolist(), b["lag"].tolist(), [len(r.prompt) for r in mb])
           for b, mb in _micro_batches(rows, 64, 0, rows, [], "cpu")]
    assert got == [(2, [3.0, 3.0], [1, 1], [4, 4]), (2, [3.0, 0.0], [1, 0], [20])]
    alone = [(b["input_ids"].shape[0], b["mask"].sum().item()) for b, _ in _micro_batches(rows, 40, 0, rows, [], "cpu")]
    assert alone == [(2, 6.0), (1, 3.0)]  # two long rows (64 tokens) do not fit 40: the lone row stays alone


def test_compiled_layers_are_not_guarded_on_rows_times_length():
    """Inductor fuses mix-order reductions only past 5 Mi elements of rows x length, a guard that compiled every layer
    again when a micro-batch crossed it mid-run: trainer.compile turns them off."""
    from learner.model import compile_layers

    class Layer(torch.nn.Linear):
        pass

    class Model(torch.nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(2, 2), Layer(2, 2)

    model, seen = Model(), []
    for layer in (model.a, model.b):
        layer.compile = lambda **kw: seen.append(kw)
    assert compile_layers(model) == 2
    assert seen == [{"dynamic": True, "options": {"triton.mix_order_reduction": False}}] * 2


def test_masked_leaves_tokens_outside_the_bounds_out_instead_of_truncating():
    """IcePop: a token whose behaviour weight exp(prox - mu) is outside [0.5, 2] gets no gradient at all; inside,
    the weight is applied untruncated."""
    logp = torch.log(_t(0.5, 0.5, 0.5)).requires_grad_()
    mu = torch.log(_t(0.4, 0.1, 0.9))  # weights 1.25 (kept), 5 (too high), 0.56 (kept)
    loss, stats = token_loss(logp, mu, _t(1.0, 1.0, 1.0), "masked", token_mask=(0.5, 2.0))
    assert stats["masked"].tolist() == [0.0, 1.0, 0.0]
    assert stats["is_weight"].tolist() == pytest.approx([1.25, 0.0, 0.5 / 0.9])
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.25, 0.0, -0.5 / 0.9])
    decoupled, _ = token_loss(logp.detach(), mu, _t(1.0, 1.0, 1.0), "decoupled", is_cap=2.0)
    assert decoupled.tolist() == pytest.approx([-1.25, -2.0, -0.5 / 0.9])  # truncated to 2, not masked


def test_the_geometric_sequence_mask_and_the_step_health_by_lag():
    from learner.health import StepHealth
    from learner.step import seq_kept

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    mu = torch.zeros(3, 3)
    prox = torch.tensor([[0.0005, -0.0005, 9.0], [0.01, 0.01, 0.01], [0.0, 0.0, 0.0]])  # row 0: mean 0 (9 is padding)
    batch = {"mask": mask, "mu": mu, "lag": torch.tensor([0, 2, 0]), "temperature": torch.ones(3, 1, 1)}
    kept = seq_kept(prox, batch, [0.999, 1.001])
    assert kept.tolist() == [1.0, 0.0, 1.0]  # row 1: exp(0.01) = 1.01 is outside
    assert seq_kept(prox, batch, None).tolist() == [1.0, 1.0, 1.0]
    health = StepHealth(max_lag=2)
    stats = {"is_weight": torch.exp(prox - mu), "masked": torch.zeros(3, 3), "clipped": torch.zeros(3, 3)}
    logits = torch.zeros(3, 3, 7)  # uniform over 7 tokens: entropy log 7 at each trained position
    health.add(batch, logits, prox, stats, kept)
    out = health.summary()
    assert out["mismatch/kl_lag0"] < 1e-6 < out["mismatch/kl_lag2"]  # lag 0: prox == mu up to 5e-4
    assert "mismatch/kl_lag1" not in out  # no sample of lag 1
    assert out["correction/seq_masked"] == pytest.approx(3 / 6)  # row 1's three of the six trained tokens
    assert out["entropy/mean"] == pytest.approx(math.log(7))
    assert out["correction/is_weight_max"] == pytest.approx(math.exp(0.01), rel=1e-5)
    assert out["correction/is_weight_p50"] == pytest.approx((math.exp(0.0005) + math.exp(0.01)) / 2, rel=1e-5)


def test_overlong_punishment_rises_linearly_over_the_buffer():
    from learner.batching import overlong_penalty

    assert [overlong_penalty(n, 100, 20, 1.0) for n in (50, 80, 90, 100, 120)] == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # buffer 0: off
    groups = [P.RolloutGroup(1, "g", 0, 0, P.pack_ints([3]), [
        P.Sample(P.pack_ints([4] * n), P.pack_floats([-1.0] * n), 1.0, [1.0], "stop", 0, 0) for n in (4, 10)])]
    rows, stats = build_rows(groups, 0, False, (10, 4, 1.0))  # 10 tokens: the whole penalty; 4: none
    assert [r.advantage for r in rows] == pytest.approx([0.5, -0.5]) and stats["reward/overlong_penalty"] == 0.5
    assert stats["reward/mean"] == 1.0  # the task's reward, before shaping


class _NanGrad(torch.autograd.Function):
    """The identity forward; its backward returns NaN: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.nan)


@pytest.mark.parametrize("per_micro_batch", [True, False])
@pytest.mark.parametrize("bad", [None, 0, 1])
def test_the_finite_guard_sees_a_gradient_that_is_not_finite_in_any_micro_batch(bad, per_micro_batch):
    """Two micro-batches, their losses finite: the step is finite unless a gradient of one of them is NaN, whether
    each micro-batch's gradients are measured (ZeRO 1-3) or their sum at the step's end (ZeRO 0); the latter is the
    step's gradient norm too."""
    from learner.model import FiniteGuard, GuardedAdamW

    model = torch.nn.Linear(3, 2)
    guard = FiniteGuard(model, GuardedAdamW(model.parameters()), per_micro_batch)
    for i in range(2):
        out = model(torch.ones(1, 3))
        loss = (_NanGrad.apply(out) if i == bad else out).sum()
        guard.add_loss(loss)
        loss.backward()
    assert guard.step_is_finite("cpu") == (bad is None)
    if not per_micro_batch and bad is None:
        want = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
        assert torch.allclose(guard.grad_norm, want)
    model.zero_grad()
    assert guard.step_is_finite("cpu")  # reset for the next step


def _row(log_w, prox=None):
    """A row of len(log_w) trained tokens whose behaviour log-probs sit log_w below its proximal ones."""
    log_w = np.asarray(log_w, np.float32)
    prox = np.full(len(log_w), np.log(0.5), np.float32) if prox is None else np.asarray(prox, np.float32)
    n = len(log_w)
    return Row(np.zeros(2, np.int32), np.ones(n, np.int32), prox - log_w, np.ones(n, np.uint8), 1.0, 1.0, 0, prox)


def _call(loss, row, adv, logp=None):
    """The update's loss on one row as its own micro-batch: (loss, d loss / d logp, stats), in float64."""
    prox = torch.from_numpy(row.prox).double()
    logp = (prox.clone() if logp is None else torch.log(_t(*logp))).requires_grad_()
    out, stats = loss(logp, torch.from_numpy(row.behaviour).double(), _t(*adv), prox)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    return out.detach(), grad, stats


# log w = prox - mu of an update's six tokens, in two rows (two micro-batches); squares .09 .0625 0 | 0 1 .01, mean
# .19375. Algorithm 1 drops the largest square while the mean of the rest is above tau: 1 (rest .0325), then .09 (rest
# .018125), then .0625 and .01 (rest 0).
UPDATE = ([0.3, -0.25, 0.0], [0.0, 1.0, 0.1])


@pytest.mark.parametrize("tau, dropped", [(0.2, ([0, 0, 0], [0, 0, 0])), (0.04, ([0, 0, 0], [0, 1, 0])),
                                          (0.03, ([1, 0, 0], [0, 1, 0])), (0.001, ([1, 1, 0], [0, 1, 1]))])
def test_m2po_drops_the_largest_second_moments_of_the_whole_update_until_the_rest_is_under_tau(tau, dropped):
    """M2PO's Algorithm 1 over the update's tokens, all its micro-batches: at tau 0.04 it drops exactly the token of
    largest (log w)^2 in the second row, and none of the first, whose own mean (.0508) alone is above tau. A kept token
    is trained with its untruncated behaviour weight (value and gradient -w A, r = 1), a dropped one not at all."""
    from learner.loss import Loss

    rows = [_row(x) for x in UPDATE]
    loss = Loss("m2po", m2po_tau=tau).for_update(rows)
    for row, log_w, want, adv in zip(rows, UPDATE, dropped, ([1.0] * 3, [-1.0] * 3), strict=True):
        out, grad, stats = _call(loss, row, adv)
        assert stats["masked"].tolist() == want
        by_hand = [0.0 if m else -math.exp(x) * a for x, m, a in zip(log_w, want, adv, strict=True)]
        assert out.tolist() == pytest.approx(by_hand, rel=1e-6) and grad.tolist() == pytest.approx(by_hand, rel=1e-6)
        assert stats["is_weight"].tolist() == pytest.approx([abs(v) for v in by_hand], rel=1e-6)


def test_m2po_leaves_the_samples_the_sequence_mask_drops_out_of_its_statistic():
    """trainer.seq_mask [0.9, 1.1] leaves out the second row (geometric mean weight exp(.367) = 1.44): the second
    moment is the first row's alone, .0508 > 0.04, and its largest square goes."""
    from learner.loss import Loss

    rows = [_row(x) for x in UPDATE]
    loss = Loss("m2po", m2po_tau=0.04).for_update(rows, seq_mask=[0.9, 1.1])
    assert _call(loss, rows[0], [1.0] * 3)[2]["masked"].tolist() == [1, 0, 0]
    assert Loss("m2po", m2po_tau=0.04).for_update(rows[:1]).knobs == loss.knobs


def test_m2po_gradient_and_clip_at_a_later_update():
    """A later update of several: r = exp(logp - prox) is clipped as decoupled PPO's, against the proximal policy; the
    behaviour weight w = exp(prox - mu) is not truncated (w = 2.5 above trainer.is_cap 2). Nothing dropped: the mean
    of (log w)^2 is (3 x .0498 + .840) / 4 = .247 <= tau 1."""
    from learner.loss import Loss

    row = _row(np.log([1.25, 1.25, 1.25, 2.5]))
    loss = Loss("m2po", is_cap=2.0, m2po_tau=1.0).for_update([row])
    out, grad, stats = _call(loss, row, [1.0, 1.0, -1.0, 1.0], logp=[0.55, 0.7, 0.7, 0.55])
    # r = 1.1, 1.4, 1.4, 1.1. A=+1, r=1.1: -1.25 * 1.1; A=+1, r=1.4: -1.25 * 1.2 (clipped: no gradient); A=-1, r=1.4:
    # -1.25 * min(-1.4, -1.2) = 1.75 (gradient -w r A); w=2.5: -2.5 * 1.1
    assert out.tolist() == pytest.approx([-1.375, -1.5, 1.75, -2.75])
    assert grad.tolist() == pytest.approx([-1.375, 0.0, 1.75, -2.75])
    assert stats["is_weight"].tolist() == pytest.approx([1.25, 1.25, 1.25, 2.5])
    assert stats["clipped"].tolist() == [0, 1, 1, 0] and stats["masked"].tolist() == [0, 0, 0, 0]


def test_m2po_is_the_on_policy_loss_when_behaviour_proximal_and_current_agree():
    """mu = prox = logp: every weight is 1, every (log w)^2 is 0 and nothing is dropped; value and gradient are the
    on-policy policy gradient's, -A and -A dlogp, as none's and ppo's."""
    from learner.loss import Loss

    logp = torch.log(_t(0.5, 0.2, 0.9, 0.05)).requires_grad_()
    same = logp.detach().clone()
    row = _row([0.0] * 4, prox=same.numpy())
    adv = _t(1.0, -1.0, 0.5, -2.0)
    out, stats = Loss("m2po").for_update([row])(logp, same, adv, same)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    assert out.tolist() == pytest.approx([-1.0, 1.0, -0.5, 2.0])
    assert grad.tolist() == pytest.approx([-1.0, 1.0, -0.5, 2.0])
    assert stats["masked"].tolist() == [0] * 4 and stats["is_weight"].tolist() == [1.0] * 4
    for variant in ("none", "ppo"):
        want, _ = token_loss(logp, same, adv, variant)
        assert torch.equal(out, want) and torch.equal(grad, torch.autograd.grad(want.sum(), logp)[0])


@pytest.mark.parametrize("overrides, message", [
    (["trainer.loss=m2po", "trainer.m2po_tau=0"], "trainer.m2po_tau: must be > 0, got 0.0"),
    (["trainer.loss=m2po", "trainer.m2po_tau=.nan"], "trainer.m2po_tau: must be a finite number, got nan"),
    (["trainer.loss=decoupled", "trainer.m2po_tau=0.1"],
     "trainer.m2po_tau: set to 0.1, but trainer.loss is 'decoupled' and only m2po reads it; "
     "use trainer.loss: m2po, or leave trainer.m2po_tau out"),
    (["trainer.loss=m2p0"], "trainer.loss: 'm2p0' is not one of 'none', 'ppo', 'tis', 'decoupled', 'masked', 'm2po'"),
])
def test_a_loss_and_its_knob_are_checked_at_load(overrides, message):
    from learner.loss import Loss
    from pipeline.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as e:
        config_from_dict({}, overrides)
    assert message in str(e.value)
    t = config_from_dict({}).trainer  # the default loss
    decoupled = config_from_dict({}, ["trainer.loss=decoupled"]).trainer
    assert t.loss == "m2po" and t.m2po_tau == 0.04 and Loss.of(t).needs_proximal
    assert not Loss.of(decoupled).needs_proximal
