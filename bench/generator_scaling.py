"""generator_scaling: rollout tokens/s reaching the hub with 1, 2, 3 generator GPUs.

The learner's side is the real hub (hub/hub.py, in this process, real ZeroMQ sockets) with a
consumer that takes each batch and marks it trained at once, so the figure is what the generators
deliver, not what one learner GPU can train on. Generators are real `pipeline generator` processes,
one per GPU, added while the run goes on (the elastic path): generator i starts after the window of
i generators is measured. A window starts once the newest generator has delivered groups for
`--warmup` seconds and lasts `--window` seconds. Target: 2 GPUs >= 1.9x one, 3 GPUs >= 2.8x one.

    python -m bench.generator_scaling --gpus 1,2,3
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from bench.common import (
    Services,
    add_model_args,
    model_from_args,
    result_name,
    run_config,
    standalone_hub,
    write_dataset,
    write_result,
)


class Consumer:
    """Takes batches from the hub and finishes each step at once (version stays 0: nothing is stale), and
    samples, every 50 ms, each generator's token count at the hub."""

    def __init__(self, hub):
        self.hub = hub
        self.samples: dict[str, list[tuple[float, int]]] = {}  # generator -> [(time, tokens so far)]
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._take, self._sample)]

    def _take(self) -> None:
        from hub.hub import HubStopped

        while not self._stop.is_set():
            try:
                self.hub.take_batch(0)
            except HubStopped:
                return
            self.hub.finish_step(0)

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            with self.hub.lock:
                counts = {g.generator_id: g.tokens for g in self.hub.registry.generators.values()}
            for g, n in counts.items():
                if n:
                    self.samples.setdefault(g, []).append((now, n))
            time.sleep(0.05)

    def rates(self, t0: float, t1: float) -> dict[str, float]:
        """Tokens/s per generator: the least-squares slope of its token count over [t0, t1]. A generator
        delivers in bursts (a lease's groups finish together, seconds apart), and the difference of the
        counts at the window's ends would be off by up to a burst."""
        out = {}
        for g, seen in list(self.samples.items()):
            pts = [(t, n) for t, n in seen if t0 <= t <= t1]
            if len(pts) < 2:
                continue
            mt, mn = sum(t for t, _ in pts) / len(pts), sum(n for _, n in pts) / len(pts)
            var = sum((t - mt) ** 2 for t, _ in pts)
            out[g] = sum((t - mt) * (n - mn) for t, n in pts) / var if var else 0.0
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, "generator_scaling")
    p.add_argument("--gpus", default="1,2,3", help="one generator per GPU, added in this order")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--window", type=float, default=40.0)
    p.add_argument("--enforce-eager", type=int, default=1)
    args = p.parse_args()
    from pipeline.config import config_from_dict
    from weights.files import remove_shm

    model = str(model_from_args(args))
    run_dir = Path(args.run_dir)
    data = write_dataset(run_dir.parent / "scaling.jsonl", rows=8192)
    cfg_dict = run_config(model, str(data), sampling={"max_tokens": args.max_tokens},
                          # the version stays 0, so staleness never drops anything; but the hub leases at most
                          # (max_staleness + 1) x batch_size groups, and 8 (288) capped 3 generators x 96
                          trainer={"total_steps": 10**6, "batch_size": 32, "group_size": 8, "max_staleness": 64},
                          generator={"max_inflight_groups": 96, "lease_size": 16, "max_num_seqs": 512,
                                     "gpu_memory_utilization": 0.85, "enforce_eager": bool(args.enforce_eager)})
    cfg = config_from_dict(cfg_dict)
    run_dir.mkdir(parents=True, exist_ok=True)
    hub = standalone_hub(cfg, run_dir, "scaling", model)
    hub.start()
    consumer = Consumer(hub)
    for t in consumer.threads:
        t.start()
    windows = []
    try:
        with Services(run_dir, cfg_dict) as svc:
            svc.address = hub.address
            for i, gpu in enumerate(args.gpus.split(",")):
                name = f"generator-{i}"
                svc.start_generator(name, gpus=gpu)
                deadline = time.monotonic() + 300
                while len(consumer.samples) < i + 1:  # its first group reached the hub
                    svc.check_alive()
                    assert time.monotonic() < deadline, f"{name} delivered nothing:\n{svc.tails()}"
                    time.sleep(0.2)
                time.sleep(args.warmup)
                t0, n0 = time.time(), hub.counters["tokens"]
                time.sleep(args.window)
                t1, n1 = time.time(), hub.counters["tokens"]
                per = consumer.rates(t0, t1)
                windows.append({"generators": i + 1, "gpus": args.gpus.split(",")[:i + 1], "seconds": t1 - t0,
                                "tokens_per_s": sum(per.values()),
                                "tokens_per_s_by_generator": {g: round(r) for g, r in per.items()},
                                "tokens_counted": n1 - n0, "tokens_per_s_counted": (n1 - n0) / (t1 - t0)})
                print(json.dumps(windows[-1]), flush=True)
    finally:
        hub.stop()
        remove_shm("scaling")
    one = windows[0]["tokens_per_s"] if windows else 0
    for w in windows:
        w["speedup_vs_1"] = w["tokens_per_s"] / one if one else None
    metrics = {"windows": windows, "target": "2 GPUs >= 1.9x, 3 GPUs >= 2.8x one",
               "workload": {"batch_size": 32, "group_size": 8, "max_tokens": args.max_tokens, "prompt_tokens": 32,
                            "max_inflight_groups": 96, "max_num_seqs": 512, "enforce_eager": bool(args.enforce_eager)},
               "learner": "hub + a consumer that marks each batch trained at once (no training)",
               "estimator": "tokens_per_s: sum over generators of the least-squares slope of its token count at the "
                            "hub (sampled every 50 ms) over the window; tokens_per_s_counted: tokens arriving in "
                            "the window / its length"}
    name = result_name("generator_scaling", args.model_size, f"{len(args.gpus.split(','))}gpus")
    write_result(name, "python -m bench.generator_scaling " + " ".join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16", metrics)


if __name__ == "__main__":
    main()
