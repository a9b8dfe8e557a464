"""zero3_gather: the learner's ZeRO-3 gather of a full weights version, parameter by parameter vs. in groups.

Two learner ranks (gloo on CPU, nccl on GPUs) hold a random-weight model of a Qwen2.5 shape under ZeRO-3;
rank 0 walks `learner.model.gathered_weights` and copies every parameter into flat buckets as the
publisher does (weights.plan.Packer, nothing sent). Per pass, milliseconds until the loop returns
(`returned`: the learner's time) and until the device is done (`ms`), for group bytes 0 (one parameter per
all-gather), the default (learner.model.GATHER_BYTES), and the default plus the publisher's CPU copy of each
bucket (learner.publisher.HostCopy, into pinned buffers; a warm-up pass allocates them). On GPUs that last
variant is also profiled once: `profile` lists the calls that took the most CPU time.

    python -m bench.zero3_gather --model-size 0.5b              # CPU: two gloo ranks
    python -m bench.zero3_gather --model-size 7b --gpus 0,1     # two GPUs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch


def rank_main(args) -> None:
    import deepspeed

    from bench.common import median, qwen_shaped_config
    from learner.model import GATHER_BYTES, gathered_weights, init_distributed
    from learner.publisher import HostCopy
    from weights.plan import Packer, manifest, unpack

    rank, _ = init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from transformers import Qwen2ForCausalLM

    with deepspeed.zero.Init(config_dict_or_path=_ds_config(), dtype=torch.bfloat16):
        model = Qwen2ForCausalLM(qwen_shaped_config(args.model_size))
    engine, *_ = deepspeed.initialize(model=model, config=_ds_config())
    plan = manifest(engine.module.named_parameters())
    nbytes = sum(p.ds_numel * p.element_size() for p in engine.module.parameters())
    out = {"bytes": nbytes, "parameters": len(plan)}
    copy, buffers = HostCopy(), {}

    def one_pass(limit: int, host_copy: bool) -> tuple[float, float]:
        _sync(cuda)
        t = time.perf_counter()
        emit = (lambda flat, idx, offs: copy.store(buffers, unpack(flat, plan, idx, offs), flat)) if host_copy \
            else (lambda flat, idx, offs: None)
        copy.begin(device)
        packer = Packer(plan, device, emit)
        for _, tensor in gathered_weights(engine, 3, group_bytes=limit):
            if rank == 0:
                packer.add(tensor)
        copy.seal()
        returned = (time.perf_counter() - t) * 1000
        _sync(cuda)
        return returned, (time.perf_counter() - t) * 1000

    for name, limit, host_copy in (("group_bytes_0", 0, False), (f"group_bytes_{GATHER_BYTES}", GATHER_BYTES, False),
                                   ("groups_and_cpu_copy", GATHER_BYTES, True)):
        if host_copy:
            one_pass(limit, host_copy)  # allocates the pinned buffers
        runs = [one_pass(limit, host_copy) for _ in range(args.passes)]
        out[name] = {"ms_per_pass": [b for _, b in runs], "ms_median": median([b for _, b in runs]),
                     "returned_ms_median": median([a for a, _ in runs])}
    if cuda:
        out["profile"] = _profile(lambda: one_pass(GATHER_BYTES, True), rank)
    if rank == 0:
        from bench.common import result_name, write_result

        a, b = out["group_bytes_0"]["ms_median"], out[f"group_bytes_{GATHER_BYTES}"]["ms_median"]
        out["speedup"] = a / b
        print(out, flush=True)
        name = args.name or result_name("zero3_gather", args.model_size, gpus=bool(args.gpus))
        write_result(name, "python -m bench.zero3_gather " + " ".join(args.argv),
                     f"random-weight Qwen2.5-{args.model_size} shape, bf16, ZeRO-3 over 2 ranks", out)


def _ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


def _profile(fn, rank: int) -> list:
    """[name, self CPU ms, calls] of the 15 calls that took the most CPU time in one run of `fn` (rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return [[e.key, round(e.self_cpu_time_total / 1000, 2), e.count] for e in rows] if rank == 0 else []


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", default="0.5b")
    p.add_argument("--gpus", default=None, help="two GPUs, e.g. 0,1 (default: CPU, gloo)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--name", default=None, help="result file name (default: zero3_gather_SIZE_MACHINE)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--rank"]
    if args.rank:
        rank_main(args)
        return 0
    if not args.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks (gloo) even on a machine with GPUs
    return _spawn_ranks([*args.argv, "--rank"], 2, args.gpus)


def _spawn_ranks(argv: list[str], world: int, gpus: str | None) -> int:
    """This module once per rank, as the learner's ranks are started: one failing stops the other."""
    from learner.launch import rank_env, supervise
    from pipeline.netutil import free_port

    port, command = str(free_port()), [sys.executable, "-m", "bench.zero3_gather", *argv]
    return supervise([subprocess.Popen(command, env=rank_env(rank, world, gpus, port)) for rank in range(world)])


if __name__ == "__main__":
    sys.exit(main())
