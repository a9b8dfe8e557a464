"""What a batch costs to reach the other learner ranks over their gloo group (learner/model.py `control_group`): two
ranks in processes of their own, rank 0's `broadcast_batch` of GROUPS groups of 8 samples of TOKENS tokens (encoded,
sent, decoded and checked on rank 1, as in a run), PASSES times after two unmeasured ones. CPU only.

    python -m bench.control_batch [--groups 32] [--tokens 1024] [--passes 10]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time


def _rank(rank: int, port: int, args: argparse.Namespace, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    import numpy as np
    import torch.distributed as dist

    from learner.model import control_group
    from learner.service import broadcast_batch
    from pipeline import protocol as P
    from pipeline.config import Config

    dist.init_process_group("gloo")
    group = control_group(2, 120)
    rng = np.random.default_rng(0)

    def sample() -> P.Sample:  # a completion of TOKENS tokens with their sampled log-probs
        tokens, logprobs = rng.integers(0, 150_000, args.tokens).tolist(), (rng.random(args.tokens) - 2).tolist()
        return P.Sample(P.pack_ints(tokens), P.pack_floats(logprobs), 1.0, [1.0], "length", 0, 0)

    groups = [P.RolloutGroup(1, "g", pid, 0, P.pack_ints(rng.integers(0, 150_000, 200).tolist()),
                             [sample() for _ in range(8)]) for pid in range(args.groups)]
    seconds = []
    for _ in range(args.passes + 2):
        dist.barrier(group=group)
        began = time.perf_counter()
        got, _, _ = broadcast_batch(groups if rank == 0 else None, {"trainer.lr": 1e-6}, Config(), "", rank, 2, group)
        seconds.append(time.perf_counter() - began)
    assert got is not None and len(got) == args.groups
    if rank == 1:
        out.put((sum(len(P.encode(g)) for g in groups), sorted(seconds[2:])))
    dist.destroy_process_group()


def main() -> None:
    from bench.common import result_name, write_result
    from pipeline.netutil import reserved_port

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--passes", type=int, default=10)
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = reserved_port()
    ranks = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        size, seconds = out.get(timeout=300)
    finally:
        for proc in ranks:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    ms = [1000 * s for s in seconds]
    write_result(result_name("control_batch", f"{args.groups}x8x{args.tokens}", gpus=False),
                 f"python -m bench.control_batch --groups {args.groups} --tokens {args.tokens} --passes {args.passes}",
                 "none", {"batch_bytes": size, "median_ms": ms[len(ms) // 2], "max_ms": ms[-1], "min_ms": ms[0]})


if __name__ == "__main__":
    main()
