"""What each trainer.loss costs per step, on the CPU: the loss itself (forward and backward of `learner.loss.Loss` on a
synthetic batch of 128 rows x 300 trained tokens, 38,400, the size of the arith grid's batches, and the statistic of
an update that m2po's mask needs), and a whole learner step of m2po against decoupled on a builtin model (the same
engine, steps taken in turns), with the no-grad proximal forward m2po adds at trainer.minibatches 1. Process CPU
seconds: a shared machine's wall time is noisy.

    python -m bench.loss_cost [--size smollm2] [--groups 2] [--group-size 4] [--prompt 32] [--completion 96] [--reps 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from bench.common import result_name, write_result
from bench.learner_step import groups
from learner.batching import Row
from learner.loss import LOSSES, Loss


def loss_ms(rows: int = 128, length: int = 300, reps: int = 100) -> dict:
    """{loss: {"update_ms", "call_ms"}}: the fastest of `reps` for_update and forward + backward of the loss."""
    rng = np.random.default_rng(0)
    prox = -rng.random((rows, length)).astype(np.float32) * 3
    mu = (prox + rng.normal(0, 0.3, prox.shape)).astype(np.float32)
    batch = [Row(np.zeros(4, np.int32), np.zeros(length, np.int32), mu[i], np.ones(length, np.uint8), 1.0, 1.0, 0,
                 prox[i]) for i in range(rows)]
    adv = torch.from_numpy(rng.normal(0, 1, (rows, 1)).astype(np.float32)).expand(rows, length)
    out = {}
    for name in LOSSES:
        loss, update, call = Loss(name), [], []
        for _ in range(reps):
            logp = torch.from_numpy(prox).clone().requires_grad_()
            t0 = time.perf_counter()
            fn = loss.for_update(batch)
            t1 = time.perf_counter()
            fn(logp, torch.from_numpy(mu), adv, torch.from_numpy(prox))[0].sum().backward()
            update.append(t1 - t0)
            call.append(time.perf_counter() - t1)
        out[name] = {"update_ms": round(min(update) * 1e3, 3), "call_ms": round(min(call) * 1e3, 3)}
    return out


def step_s(args) -> dict:
    """{loss: {"step_cpu_s", "proximal_cpu_s"}}: medians over args.reps steps each, after one of each."""
    import learner.step
    from learner.model import build_engine, init_distributed
    from pipeline.config import config_from_dict
    from pipeline.tinymodel import resolve_model_path

    path = resolve_model_path(f"builtin:{args.size}")
    cfg = config_from_dict({"model": {"path": path}, "trainer": {"batch_size": args.groups, "lr": 1e-6,
                                                                 "group_size": args.group_size},
                            "sampling": {"max_tokens": args.completion},
                            "generator": {"max_model_len": args.prompt + args.completion + 8}})
    init_distributed()
    engine, extras = build_engine(cfg, path)
    proximal, real = [], learner.step.proximal

    def timed(*a):
        t0 = time.process_time()
        real(*a)
        proximal.append(time.process_time() - t0)

    learner.step.proximal = timed
    seen: dict = {"decoupled": [], "m2po": []}
    for i in range(2 * (args.reps + 1)):
        cfg.trainer.loss = "m2po" if i % 2 else "decoupled"
        batch = groups(args.groups, args.group_size, args.prompt, args.completion, engine.module.config.vocab_size, i)
        proximal.clear()
        t0 = time.process_time()
        learner.step.train_step(engine, extras, batch, cfg, i, 0)
        if i >= 2:
            seen[cfg.trainer.loss].append((time.process_time() - t0, sum(proximal)))
    return {k: {"step_cpu_s": round(statistics.median(s for s, _ in v), 3),
                "proximal_cpu_s": round(statistics.median(p for _, p in v), 3)} for k, v in seen.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="smollm2", help="builtin model: tiny or smollm2")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--completion", type=int, default=96)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = {"loss_38400_tokens": loss_ms(), "step": step_s(args),
           "step_tokens": args.groups * args.group_size * (args.prompt + args.completion)}
    out["m2po_over_decoupled"] = round(out["step"]["m2po"]["step_cpu_s"] / out["step"]["decoupled"]["step_cpu_s"], 3)
    write_result(result_name("loss_cost", args.size, gpus=False), "python -m bench.loss_cost " + " ".join(sys.argv[1:]),
                 f"builtin:{args.size}", out, settings=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
