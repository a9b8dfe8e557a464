"""weight_sync: from the end of the optimizer step to the generator running on the new weights.

For each transport (nccl, shm, zmq) one short learner + generator run; per weights version it reads
  learner   metrics.jsonl `sync/weights_ms`: its critical path (gather, pack, nccl broadcasts), and
            `sync/broadcast_ms`: the broadcasts alone (learner waiting on NCCL, per version), and
            `sync/copy_wait_ms`: waiting for the CPU copies of sent buckets to free device memory;
            the rest is gathering (ZeRO-3) and packing;
  generator "weights vN applied: X ms (Y ms stopped), Z ms after the optimizer step": X = fetch + load,
            Y = engine not generating, Z = optimizer step end -> generator on the new weights (the figure);
            staged nccl adds "received in R ms": announcement -> every worker's receiver thread has the bytes.
Then the raw transfer of the same number of bytes: memcpy in RAM, /dev/shm write + read, and an NCCL
broadcast GPU 0 -> GPU 1 (reference for a GPU-to-GPU transport).

    python -m bench.weight_sync --sizes 0.5b --transports nccl,shm,zmq
    python -m bench.weight_sync --sizes 0.5b --transports nccl,nccl:unstaged   # weights.staging on, off
    python -m bench.weight_sync --sizes 7b --transports nccl --learner-gpus 0,1 --generator-gpus 2 --zero-stage 3
    python -m bench.weight_sync --cpu --netns --sizes smollm2 --transports nccl,zmq   # two hosts (namespaces)
With --netns the learner and the generator run on two hosts (bench/netns.py), and the raw transfer is a gloo
broadcast of a version's bytes between them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (
    Services,
    build_model,
    log_times,
    median,
    result_name,
    run_config,
    write_dataset,
    write_result,
)

APPLIED = re.compile(r"weights v(\d+) applied: (\d+) ms \((\d+) ms stopped\), (\d+) ms after the optimizer step"
                     r"(?:; received in (\d+) ms)?")


def one_run(size: str, model: str, data: str, transport: str, run_dir: Path, args) -> dict:
    steps = args.steps
    name, _, variant = transport.partition(":")  # nccl:unstaged: weights.staging off
    cfg = run_config(model, data, sampling={"max_tokens": 32},
                     trainer={"total_steps": steps + 3, "batch_size": 8, "group_size": 4, "max_staleness": 1,
                              "zero_stage": args.zero_stage},
                     weights={"transport": name, "staging": variant != "unstaged"})
    if args.cpu:
        cfg["model"]["dtype"] = "float32"
    prefix = {}
    if args.hosts is not None:  # the learner on host a, the generator on host b: every byte crosses their link
        cfg["hub"].update(host=args.hosts.address["a"], allow_insecure=True)  # two namespaces of this machine
        prefix = {"learner": args.hosts.prefix("a"), "generator": args.hosts.prefix("b")}
    with Services(run_dir, cfg, use_gpus=not args.cpu, prefix=prefix) as svc:
        svc.start_learner(gpus=args.learner_gpus, timeout=600)
        svc.start_generator(gpus=args.generator_gpus)
        svc.wait_steps(steps, timeout=300)
        deadline = time.monotonic() + 30  # let the last versions be applied
        while time.monotonic() < deadline and not any(
                e["version"] >= steps for e in svc.events("weights_applied")):
            time.sleep(0.1)
        records = svc.metrics()
    lines = [APPLIED.search(line) for _, line in log_times(run_dir / "logs" / "generator-0.log", "applied:")]
    applied = [dict(version=int(m[1]), total_ms=int(m[2]), stopped_ms=int(m[3]), after_step_ms=int(m[4]),
                    **({"received_ms": int(m[5])} if m[5] else {})) for m in lines if m]
    steady = [a for a in applied if a["version"] >= 2] or applied  # v1 includes first-use warm-up
    steady_records = records[1:] or records
    publish = [r["sync/weights_ms"] for r in steady_records]
    broadcast = [r.get("sync/broadcast_ms", 0.0) for r in steady_records]
    return {
        "transport": transport, "model_size": size, "versions": applied,
        "learner_publish_ms_median": median(publish),
        "learner_broadcast_ms_median": median(broadcast),
        "learner_copy_wait_ms_median": median([r.get("sync/copy_wait_ms", 0.0) for r in steady_records]),
        "generator_fetch_load_ms_median": median([a["total_ms"] for a in steady]),
        "generator_stopped_ms_median": median([a["stopped_ms"] for a in steady]),
        "generator_received_ms_median": median([a["received_ms"] for a in steady if "received_ms" in a]),
        "step_end_to_applied_ms_median": median([a["after_step_ms"] for a in steady]),
        "step_end_to_applied_ms_min": min((a["after_step_ms"] for a in steady), default=None),
        "acks": len(svc.events("weights_applied")),
        "version_bytes": steady_records[-1].get("sync/version_bytes") if steady_records else None,
        "transports": [e["transport"] for e in svc.events("register")],
    }


def raw_transfers(nbytes: int, cpu: bool, hosts=None) -> dict:
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time.perf_counter()
    for _ in range(3):
        np.copyto(dst, src)
    memcpy_ms = (time.perf_counter() - t) / 3 * 1000
    path = Path("/dev/shm") / f"bench-raw-{os.getpid()}"
    t = time.perf_counter()
    path.write_bytes(src.tobytes())
    write_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    path.read_bytes()
    read_ms = (time.perf_counter() - t) * 1000
    path.unlink()
    out = {"bytes": nbytes, "memcpy_ms": memcpy_ms, "shm_write_ms": write_ms, "shm_read_ms": read_ms}
    if not cpu:
        out["nccl_broadcast_ms"] = _nccl_broadcast_ms(nbytes)
    if hosts is not None:
        out["gloo_broadcast_between_hosts_ms"] = _gloo_broadcast_ms(nbytes, hosts)
        # the same while host b's cores are busy, as a generator's are while its engine generates (on CPU)
        out["gloo_broadcast_between_hosts_b_busy_ms"] = _gloo_broadcast_ms(nbytes, hosts, busy=os.cpu_count())
    return out


GLOO_BROADCAST = """
import os, sys, time, datetime, torch, torch.distributed as dist
rank, nbytes = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
buf = torch.empty(nbytes, dtype=torch.uint8)
dist.broadcast(buf, 0)
times = []
for _ in range(5):
    dist.barrier()
    t = time.perf_counter()
    dist.broadcast(buf, 0)
    times.append((time.perf_counter() - t) * 1000)
if rank == 1:
    print(sorted(times)[2])
"""


def _gloo_broadcast_ms(nbytes: int, hosts, busy: int = 0) -> float:
    """The raw transfer between the two hosts: a gloo broadcast of `nbytes` from host a to host b (median of 5);
    `busy`: with that many busy loops running on host b meanwhile."""
    from pipeline.netutil import free_port

    loops = [subprocess.Popen([*hosts.prefix("b"), sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        env = {**os.environ, "MASTER_ADDR": hosts.address["a"], "MASTER_PORT": str(free_port())}
        procs = [subprocess.Popen([*hosts.prefix(host), sys.executable, "-c", GLOO_BROADCAST, str(rank),
                                   str(nbytes)], env=env, stdout=subprocess.PIPE, text=True)
                 for rank, host in enumerate("ab")]
        out = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for loop in loops:  # by PID: the processes this started
            loop.kill()
            loop.wait()
    return float(out[1])


def _nccl_worker(rank: int, nbytes: int, port: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        dist.broadcast(buf, 0)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    if rank == 1:
        q.put(median(times))
    dist.destroy_process_group()


def _nccl_broadcast_ms(nbytes: int) -> float | None:
    import torch.multiprocessing as mp

    from pipeline.netutil import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_worker, args=(r, nbytes, port, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(120)
    return q.get(timeout=5) if not q.empty() else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="0.5b")
    p.add_argument("--transports", default="nccl,shm,zmq")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--runs", default="/tmp/bench-runs")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--learner-gpus", default="0", help="several: one learner rank each (7B: 0,1 with ZeRO-3)")
    p.add_argument("--generator-gpus", default="1")
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--name", default=None, help="result file name (default: weight_sync_TRANSPORTS_SIZES_MACHINE)")
    p.add_argument("--netns", action="store_true",
                   help="the learner and the generator on two hosts: network namespaces of this machine (root)")
    args = p.parse_args()
    if args.netns:
        from bench.netns import HostPair

        with HostPair() as args.hosts:
            _measure(args)
    else:
        args.hosts = None
        _measure(args)


def _measure(args) -> None:
    data = str(write_dataset(Path(args.runs) / "sync.jsonl", rows=2048))
    results = {}
    for size in args.sizes.split(","):
        model = build_model(size, Path(args.models) / f"q-{size}")
        nbytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        entry = {"model_bytes": nbytes}
        for transport in args.transports.split(","):
            try:
                entry[transport] = one_run(size, str(model), data, transport,
                                           Path(args.runs) / f"sync-{size}-{transport.replace(':', '-')}", args)
            except Exception as e:  # keep the other measurements
                entry[transport] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
            print(size, transport, entry[transport], flush=True)
        version_bytes = [entry[t]["version_bytes"] for t in entry if isinstance(entry[t], dict)
                         and entry[t].get("version_bytes")]
        entry["raw"] = raw = raw_transfers(version_bytes[0] if version_bytes else nbytes, args.cpu, args.hosts)
        nccl, raw_ms = entry.get("nccl", {}), raw.get("nccl_broadcast_ms") or raw.get("gloo_broadcast_between_hosts_ms")
        if raw_ms and nccl.get("step_end_to_applied_ms_median"):  # share of the raw bandwidth reached
            nccl["raw_fraction_end_to_end"] = raw_ms / nccl["step_end_to_applied_ms_median"]
            if nccl.get("learner_broadcast_ms_median"):
                nccl["raw_fraction_broadcasts"] = raw_ms / nccl["learner_broadcast_ms_median"]
        results[size] = entry
    zero = f"zero{args.zero_stage}" if args.zero_stage else ""
    name = args.name or result_name("weight_sync", args.transports, args.sizes, zero, "netns" if args.hosts else "",
                                    gpus=not args.cpu)
    write_result(name, "python -m bench.weight_sync " + " ".join(sys.argv[1:]),
                 "random-weight Qwen2.5 shapes, bf16 (" + args.sizes + ")", results)


if __name__ == "__main__":
    main()
