"""A learner's steps on fixed groups, run by torchrun with gloo ranks (tests/integration/test_ranks.py): for each
scenario, each rank writes its weights and step statistics to OUT/NAME/rank{RANK}.pt.

    python -m torch.distributed.run --nproc-per-node N tests/integration/rank_steps.py OUT SPECS_JSON

SPECS: {NAME: {"config": {...}, "steps": n, "live_lr": x}}, run one after another in the same processes. With
`live_lr`, rank 0's own config gets trainer.lr = x after each batch's knobs were read, as a `pipeline set` reaching
rank 0's hub between the batch and the step would."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def groups(n: int):
    """Groups whose samples differ in length and tokens (so their advantages do not cancel and the rows pack into
    several micro-batches)."""
    from pipeline import protocol as P

    out = []
    for pid in range(n):
        samples = []
        for i in range(2):
            tokens = [4 + (pid + i + j) % 10 for j in range(3 + (pid + i) % 4)]
            samples.append(P.Sample(P.pack_ints(tokens), P.pack_floats([-2.3 + 0.1 * i] * len(tokens)), float(i),
                                    [float(i)], "stop", 0, 0))
        out.append(P.RolloutGroup(1, "g", pid, 0, P.pack_ints([4, 5 + pid % 3, 3]), samples))
    return out


def main(out: str, specs: dict) -> None:
    import torch.distributed as dist

    from learner.model import control_group, init_distributed
    from pipeline.tinymodel import resolve_model_path

    resolve_model_path("builtin:tiny")  # before the process group, as the learner does: transformers writes a
    # model on rank 0 of a group only, so a rank that built it first inside one would fail
    rank, world = init_distributed()
    control = control_group(world)
    for name, spec in specs.items():
        Path(out, name).mkdir(parents=True, exist_ok=True)
        run(f"{out}/{name}/rank{rank}.pt", spec, rank, world, control)
        dist.barrier()


def run(path: str, spec: dict, rank: int, world: int, control) -> None:
    from learner.model import build_engine, gathered_weights
    from learner.service import broadcast_batch
    from learner.step import train_step
    from pipeline.config import config_from_dict
    from pipeline.runtime_knobs import runtime_values
    from pipeline.tinymodel import PAD_ID, resolve_model_path

    cfg = config_from_dict(spec["config"])
    engine, extras = build_engine(cfg, resolve_model_path("builtin:tiny"))
    stats = []
    for step in range(spec["steps"]):
        batch, knobs = (groups(8), runtime_values(cfg)) if rank == 0 else (None, {})
        if rank == 0 and "live_lr" in spec:
            cfg.trainer.lr = spec["live_lr"]
        batch, knobs, _ = broadcast_batch(batch, knobs, cfg, "", rank, world, control)
        stats.append(train_step(engine, extras, batch, cfg, step, PAD_ID, knobs))
    weights = {name: t.detach().clone() for name, t in gathered_weights(engine, cfg.trainer.zero_stage)}
    torch.save({"weights": weights, "stats": stats}, path)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
