"""generator.copyplan: vLLM-style loading (stacked q/k/v, a tensor-parallel shard, a padded vocabulary),
recorded once from staging buffers and replayed for the next version, gives what loading it would."""

from __future__ import annotations

import pytest
import torch

from generator import copyplan

HIDDEN, VOCAB, PADDED = 8, 10, 16


class StackedModel(torch.nn.Module):
    """Loads like vLLM: q/k/v into one stacked parameter, a row shard of o_proj (rank 1 of 2, a strided view
    of the checkpoint tensor), the embedding into the first rows of a padded one and zeros after."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.empty(3 * HIDDEN, HIDDEN, dtype=torch.bfloat16))
        self.o_shard = torch.nn.Parameter(torch.empty(HIDDEN, HIDDEN // 2, dtype=torch.bfloat16))
        self.embed = torch.nn.Parameter(torch.empty(PADDED, HIDDEN, dtype=torch.float32))  # loads cast

    def load_weights(self, named):
        for name, t in named:
            if name in ("q", "k", "v"):
                i = "qkv".index(name)
                self.qkv.data.narrow(0, i * HIDDEN, HIDDEN).copy_(t)
            elif name == "o":
                self.o_shard.data.copy_(t.narrow(1, HIDDEN // 2, HIDDEN // 2))
            elif name == "embed":
                self.embed.data[:VOCAB].copy_(t)
                self.embed.data[VOCAB:].fill_(0)


def _staging(seed: int) -> tuple[torch.Tensor, list]:
    """One flat buffer holding q, k, v, o and embed (bf16), as a received bucket would."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, HIDDEN), "v": (HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN),
              "embed": (VOCAB, HIDDEN)}
    flat = torch.empty(sum(a * b for a, b in shapes.values()), dtype=torch.bfloat16)
    named, off = [], 0
    for name, (a, b) in shapes.items():
        view = flat[off:off + a * b].view(a, b)
        named.append((name, view))
        off += a * b
    flat.copy_(torch.randn(flat.numel(), generator=g).to(torch.bfloat16))
    return flat, named


def test_replay_of_the_next_version_equals_loading_it() -> None:
    flat, named = _staging(0)
    model = StackedModel()
    params = list(model.parameters())
    ops, why = copyplan.record(lambda: model.load_weights(named), [flat], params)
    assert why == "" and len(ops) == 6  # q, k, v, o, embed, and the padding's fill

    flat.copy_(_staging(1)[0])  # the next version arrives in the same buffer
    model.embed.data.fill_(7)  # the padding's fill is replayed too
    copyplan.replay(ops)
    reference = StackedModel()
    reference.load_weights(_staging(1)[1])
    for got, want in zip(params, reference.parameters(), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(copyplan.sums(params), copyplan.sums(list(reference.parameters())))


def test_a_missed_copy_shows_in_the_sums() -> None:
    flat, named = _staging(0)
    model = StackedModel()
    params = list(model.parameters())
    ops, _ = copyplan.record(lambda: model.load_weights(named), [flat], params)
    before = copyplan.sums(params)
    flat.copy_(_staging(1)[0])
    copyplan.replay([op for op in ops if op[0].data_ptr() != model.o_shard.data_ptr()])
    changed = copyplan.sums(params) != before
    assert changed.tolist() == [True, False, True]  # o_shard kept the old version's values


@pytest.mark.parametrize("load, reason", [
    (lambda m, named: m.qkv.data.narrow(0, 0, HIDDEN).copy_(named[0][1] * 2), "writes a parameter"),
    (lambda m, named: m.qkv.data.narrow(0, 0, HIDDEN).add_(named[0][1]), "writes a parameter"),
    (lambda m, named: named[0][1].mul_(2), "writes a received tensor"),
    (lambda m, named: setattr(m.qkv, "data", torch.zeros_like(m.qkv)), "replaced a parameter's storage"),
])
def test_a_load_that_computes_is_not_replayed(load, reason) -> None:
    flat, named = _staging(0)
    model = StackedModel()
    ops, why = copyplan.record(lambda: load(model, named), [flat], list(model.parameters()))
    assert ops == [] and reason in why
