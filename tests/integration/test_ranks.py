"""The learner step over two gloo ranks started by torchrun, against one rank on the same batch: the same update,
gradient norm and loss with any rank count (the loss is normalised over all ranks' tokens and DeepSpeed averages
the gradients), LoRA adapters and QLoRA's quantized base included; several mini-batches measure every row against its
proximal log-probs on whichever rank trains it; and every rank trains with the one snapshot of the run-time knobs
that rank 0 broadcast with the batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeline.netutil import reserved_port
from tests.conftest import REPO

pytestmark = pytest.mark.integration

# decoupled: the made-up log-probs (rank_steps.py) are far from the model's, and the default m2po masks every token
BASE = {"batch_size": 8, "group_size": 2, "lr": 0.01, "grad_clip": 0.1, "micro_batch_tokens": 24, "loss": "decoupled"}
SCENARIOS = {  # name: (trainer fields, steps, rank 0's live trainer.lr or None[, model fields])
    "zero0": ({"zero_stage": 0}, 2, None),
    "zero2": ({"zero_stage": 2}, 2, None),
    "minibatches4": ({"minibatches": 4, "clip_eps": 0.01}, 2, None),
    "live_lr": ({"zero_stage": 0}, 1, 0.5),
    # LoRA adapters (only they are reduced and stepped; their gradients are smaller: a clip that acts) and QLoRA's
    # 4-bit base on every rank
    "lora_zero2": ({"zero_stage": 2, "grad_clip": 0.01}, 2, None, {"lora": {"r": 4, "alpha": 8}}),
    "qlora_zero0": ({"zero_stage": 0, "grad_clip": 0.01}, 2, None,
                    {"lora": {"r": 4, "alpha": 8}, "quantization": "4bit"}),
}


def _start(out, ranks: int) -> subprocess.Popen:
    """Every scenario with `ranks` ranks (the 1-rank run without live changes), in one torchrun."""
    specs = {name: {"config": {"trainer": {**BASE, **trainer}, "model": model[0] if model else {}}, "steps": steps,
                    **({"live_lr": live} if live is not None and ranks > 1 else {})}
             for name, (trainer, steps, live, *model) in SCENARIOS.items()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(reserved_port()), "--log-dir", str(out / f"torchrun{ranks}"), "tests/integration/rank_steps.py",
           str(out / f"ranks{ranks}"), json.dumps(specs)]
    with (out / f"ranks{ranks}.log").open("w") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _results(out, ranks: int, proc: subprocess.Popen) -> dict[str, list[dict]]:
    assert proc.wait(timeout=900) == 0, (out / f"ranks{ranks}.log").read_text(errors="replace")[-9000:]
    return {name: [torch.load(out / f"ranks{ranks}" / name / f"rank{r}.pt") for r in range(ranks)]
            for name in SCENARIOS}


@pytest.fixture(scope="module")
def runs(model_cache, tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("ranks")
    started = {ranks: _start(out, ranks) for ranks in (1, 2)}  # side by side: a start is mostly imports, on one core
    try:
        return tuple(_results(out, ranks, proc) for ranks, proc in started.items())
    finally:
        for proc in started.values():
            if proc.poll() is None:  # a failure or a time-out: stopped by PID, as subprocess.run's time-out does
                proc.kill()
                proc.wait()


def _close(a: dict, b: dict, atol: float = 2e-4) -> bool:  # Adam turns float32 rounding into up to 5e-5 here
    return all(torch.allclose(a[k], b[k], atol=atol) for k in a)


@pytest.mark.parametrize("name", ["zero0", "zero2", "minibatches4", "lora_zero2", "qlora_zero0"])
def test_two_ranks_make_the_update_one_rank_makes(runs, name):
    (one,), two = runs[0][name], runs[1][name]
    for a, b in zip(one["stats"], two[0]["stats"], strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)  # not halved by the average over ranks
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)  # all ranks' share, not rank 0's
        assert b["correction/clip_frac"] == pytest.approx(a["correction/clip_frac"], abs=1e-6)
    clip = {**BASE, **SCENARIOS[name][0]}["grad_clip"]
    assert one["stats"][0]["grad_norm"] > clip  # so the clip acts and its scale matters
    if name == "minibatches4":
        assert one["stats"][1]["correction/clip_frac"] > 0.05  # the proximal policy is the batch's start
    assert _close(two[0]["weights"], two[1]["weights"], atol=0)  # the replicas agree
    assert _close(one["weights"], two[0]["weights"])


def test_every_rank_trains_with_the_knobs_the_batch_was_taken_with(runs):
    """A `pipeline set trainer.lr` that reaches rank 0's config between the batch and its step changes nothing
    of that step on any rank: the replicas stay equal and equal to a run without the change."""
    (plain,), two = runs[0]["live_lr"], runs[1]["live_lr"]
    assert two[0]["stats"][0]["lr"] == two[1]["stats"][0]["lr"] == BASE["lr"]
    assert _close(two[0]["weights"], two[1]["weights"], atol=0)
    assert _close(plain["weights"], two[0]["weights"])
