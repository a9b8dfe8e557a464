"""The hub's ceiling: how many generators one learner's hub serves, on this machine's CPU.

The hub (hub/hub.py) runs in a process of its own, as in a learner, with a consumer that takes each batch as
soon as it is buffered and finishes the step at once (a learner infinitely fast: the hub alone is the limit).
N simulated generators, in another process on one asyncio loop, speak the real protocol over real ZeroMQ sockets:
each registers, heartbeats every hub.heartbeat_s with what it holds, leases groups and pushes for each a prepared,
valid group of 8 samples x 256 tokens (stamped with the lease's version; no engines). Two loads for each N:
  --rates 0     each asks again as soon as it has pushed: the groups/s are the hub's ceiling, and the latencies those
                of a saturated hub (each of the N generators has a request waiting in its queue);
  --rates 2000  together they offer 2,000 groups/s: each waits its share of the time (N x 8 / 2,000 s a lease, +-50%)
                before pushing a lease's groups, as an engine generating them would: the latencies at that load.
The batch is sized for N (`--batch auto`): the window, max_staleness + 1 = 3 batches, holds a full lease of 8 for each
generator and a batch besides. After a warm-up, over a window of --seconds, it reports the groups validated and
buffered per second, the latency of lease and heartbeat requests (p50, p99, as the generators see them), the hub
process's CPU (cores busy), peak memory and Python's collection pauses, and the generators' process's CPU.

    python -m bench.hub_ceiling --generators 64,256,1024 --rates 0,2000 --seconds 20 [--profile FILE]

`--profile FILE` writes where the hub's time went (every thread; needs yappi): python -m pstats FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import numpy as np

from bench.common import result_name, write_result

TOKENS, GROUP, LEASE, STALENESS = 256, 8, 8, 2


def cpu() -> float:
    """CPU seconds this process has used so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch_for(n: int) -> int:
    """A batch (64 at least) whose window, (max_staleness + 1) batches in flight, holds a full lease for each of n
    generators and a batch's worth buffered besides: with less, the fair share gives each a lease of one group and
    most of them wait."""
    return max(64, -(-n * LEASE // STALENESS))


def hub_process(n: int, batch: int, conn, profile: str = "") -> None:
    from hub.hub import Hub
    from pipeline.config import config_from_dict
    from pipeline.tasks import echo_rows
    from weights import senders

    def encode(text: str) -> list[int]:  # the embedded tiny model's ids of an echo prompt: digit d is 4 + d, '=' 3
        return [3 if w == "=" else 4 + int(w) for w in text.split() if w == "=" or w.isdigit()]

    cfg = config_from_dict({
        "trainer": {"batch_size": batch, "group_size": GROUP, "total_steps": 10**6, "max_staleness": STALENESS,
                    "epochs": 10**4},
        "sampling": {"max_tokens": TOKENS}, "generator": {"lease_size": LEASE, "max_model_len": 512},
        "hub": {"max_generators": n, "heartbeat_s": 1.0, "heartbeat_timeout_s": 30.0}})
    hub = Hub(cfg, echo_rows(max(4096, 4 * batch), 0), Path(tempfile.mkdtemp(prefix="hub-ceiling-")), "bench", 0, None,
              encode=encode, vocab_size=16)
    hub.serve_weights(senders(cfg, hub, "bench"))
    hub.start()
    pauses, began = {0: [], 1: [], 2: []}, [0.0]  # Python's collections in the hub's process: they hold every thread

    def collection(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - began[0])

    gc.callbacks.append(collection)

    def consume() -> None:  # an infinitely fast learner whose weights never change (no group is ever stale)
        while True:
            hub.take_batch(0)
            hub.finish_step(0)

    threading.Thread(target=consume, daemon=True).start()
    if profile:  # where the hub's time goes, every thread (python -m pstats FILE)
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
    conn.send(hub.address)
    marks = []
    while (what := conn.recv()) != "stop":  # "mark": the counters and CPU now
        marks.append((time.perf_counter(), hub.counters["rollouts"], cpu()))
        conn.send(what)
    (t0, r0, c0), (t1, r1, c1) = marks[-2:]
    gc_pauses = {f"gen{g}": {"count": len(p), "max_ms": 1000 * max(p, default=0), "total_ms": 1000 * sum(p)}
                 for g, p in pauses.items()}  # since the start, warm-up included
    rejected = {k: v for k, v in hub.counters.items() if k not in ("rollouts", "tokens") and v}
    if profile:
        yappi.stop()
        yappi.get_func_stats().save(profile, type="pstat")
    conn.send({"groups_per_s": (r1 - r0) / (t1 - t0), "hub_cores_busy": (c1 - c0) / (t1 - t0),
               "hub_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "generators_registered": len(hub.registry.generators), "gc_pauses": gc_pauses,
               "batches_taken": hub.ledger.trained // batch, "other_counters": rejected})
    conn.close()
    os._exit(0)  # the hub's threads: nothing to keep


async def generators(n: int, address: str, seconds: float, warmup: float, conn, rate: float = 0.0) -> dict:
    import zmq
    import zmq.asyncio

    from pipeline import protocol as P

    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * n + 64)  # a context option (setsockopt would be a default of its sockets)
    tokens = P.pack_ints([4 + i % 10 for i in range(TOKENS)])
    logprobs = P.pack_floats([-1.0] * TOKENS)
    lat = {"lease": [], "wait": [], "heartbeat": []}

    @functools.cache
    def samples(v: int) -> list[dict]:  # a group's samples on the wire, made once per version: the simulated
        # generators' process must not be what limits the hub (their encoding took its core)
        return [P.as_dict(P.Sample(tokens, logprobs, float(s % 2), [float(s % 2)], "length", v, v))
                for s in range(GROUP)]
    measuring = asyncio.Event()
    stop = asyncio.Event()

    async def one(i: int) -> None:
        gen_id = f"sim-{os.getpid()}-{i}"
        dealer, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
        dealer.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        rid = 0

        async def ask(msg):
            nonlocal rid
            rid += 1
            await dealer.send(P.encode(msg, rid))
            while True:
                reply, got = P.decode(await dealer.recv(), limits=P.FROM_HUB)
                if got == rid or isinstance(reply, P.Error):
                    return reply

        await asyncio.sleep(i * 0.002)  # registrations spread over a moment, as engines come up
        spec = await ask(P.SpecRequest(gen_id))  # the run's config, which a generator adopts before registering
        welcome = await ask(P.Register(gen_id, pid=os.getpid(), spec_digest=spec.digest))
        assert isinstance(welcome, P.Welcome), welcome
        push.connect(welcome.rollouts_endpoint)
        pushed = generated = 0
        beat = time.monotonic()
        while not stop.is_set():
            if time.monotonic() - beat >= welcome.heartbeat_s:
                beat, start = time.monotonic(), time.perf_counter()
                await ask(P.Heartbeat(gen_id, welcome.version, pushed=pushed, generated=generated))
                if measuring.is_set():
                    lat["heartbeat"].append(time.perf_counter() - start)
            start = time.perf_counter()
            lease = await ask(P.LeaseRequest(gen_id, LEASE))
            if measuring.is_set():  # a request answered with a lease, or with a Wait (the window is full)
                lat["lease" if isinstance(lease, P.Lease) else "wait"].append(time.perf_counter() - start)
            if not isinstance(lease, P.Lease):  # Wait: the window is full
                await asyncio.sleep(getattr(lease, "retry_s", 0.05))
                continue
            if rate:  # its engine generates the lease's groups: together the generators offer `rate` groups/s
                await asyncio.sleep(len(lease.groups) * n / rate * random.uniform(0.5, 1.5))
            for item in lease.groups:
                wire = P.as_dict(P.RolloutGroup(
                    lease_id=lease.lease_id, generator_id=gen_id, prompt_id=item.prompt_id, epoch=item.epoch,
                    prompt_ids=item.prompt_ids, samples=[], temperature=lease.sampling.temperature,
                    session=welcome.session))
                wire.update(v=P.SCHEMA_VERSION, k=P.RolloutGroup.tag, r=0, samples=samples(lease.min_version))
                await push.send(msgpack.packb(wire, use_bin_type=True))
                pushed += 1
                generated += GROUP * TOKENS
            await asyncio.sleep(0)
        dealer.close(0)
        push.close(0)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.sleep(warmup + n * 0.002)
    conn.send("mark")
    conn.recv()
    measuring.set()
    c0 = cpu()
    await asyncio.sleep(seconds)
    busy = (cpu() - c0) / seconds
    conn.send("mark")
    conn.recv()
    measuring.clear()
    stop.set()
    failed = [e for e in await asyncio.gather(*tasks, return_exceptions=True) if isinstance(e, BaseException)]
    ctx.term()
    out = {"generators_failed": len(failed), "first_failure": repr(failed[0])[:300] if failed else "",
           "generators_cores_busy": busy}  # their process's: near 1, it may add to the latencies they see
    for name, values in lat.items():
        ms = np.array(values) * 1000
        out[name] = {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                     "count": len(ms)} if len(ms) else {"count": 0}
    return out


def measure(n: int, batch: int, seconds: float, warmup: float, profile: str = "", rate: float = 0.0) -> dict:
    parent, child = mp.Pipe()
    hub = mp.get_context("spawn").Process(target=hub_process, args=(n, batch, child, profile))
    hub.start()
    try:
        address = parent.recv()
        latency = asyncio.run(generators(n, address, seconds, warmup, parent, rate))
        parent.send("stop")
        figures = parent.recv()
    finally:
        hub.join(30)
        if hub.is_alive():
            hub.kill()  # by PID: the one process this started
            hub.join()
    return {"generators": n, "batch_size": batch, "offered_groups_per_s": rate or "all it takes", **figures,
            "latency": latency}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--generators", default="64,256,1024")
    p.add_argument("--batch", default="auto", help="trainer.batch_size; auto: a full lease for every generator")
    p.add_argument("--rates", default="0,2000", help="groups/s the generators offer together, each generating "
                   "its lease's groups in its share of the time (0: as fast as the hub takes them, its ceiling)")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--profile", default="", help="write the hub's profile here (needs yappi)")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # two sockets a generator, and their connections at the hub (root may raise the hard limit)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 65536), max(hard, 65536)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    results = []
    for n in (int(x) for x in args.generators.split(",")):
        batch = batch_for(n) if args.batch == "auto" else int(args.batch)
        for rate in (float(x) for x in args.rates.split(",")):
            results.append(measure(n, batch, args.seconds, args.warmup, args.profile, rate))
            print(results[-1], flush=True)
    write_result(result_name("hub_ceiling", f"{GROUP}x{TOKENS}", gpus=False),
                 "python -m bench.hub_ceiling " + " ".join(argv), "none (simulated generators)", results,
                 cpus=os.cpu_count())


if __name__ == "__main__":
    main(sys.argv[1:])
