"""generator_scaling: rollout tokens/s reaching the hub with 1, 2, 3 generator GPUs.

The learner's side is the real hub (learner/hub.py, in this process, real ZeroMQ sockets) with a
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

from bench.common import Services, add_model_args, model_from_args, run_config, write_dataset, write_result


class Consumer:
    """Takes batches from the hub and finishes each step at once (version stays 0: nothing is stale)."""

    def __init__(self, hub):
        self.hub = hub
        self.by_generator: dict[str, int] = {}  # tokens taken, per generator
        self.first_seen: dict[str, float] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from learner.hub import HubStopped

        while not self._stop.is_set():
            try:
                groups, _ = self.hub.take_batch(0)
            except HubStopped:
                return
            now = time.time()
            for g in groups:
                self.first_seen.setdefault(g.generator_id, now)
                n = sum(len(s.token_ids) // 4 for s in g.samples)  # packed int32 ids
                self.by_generator[g.generator_id] = self.by_generator.get(g.generator_id, 0) + n
            self.hub.finish_step(0)


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, "generator_scaling")
    p.add_argument("--gpus", default="1,2,3", help="one generator per GPU, added in this order")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--enforce-eager", type=int, default=1)
    args = p.parse_args()
    from learner.hub import Hub
    from pipeline.config import config_from_dict
    from pipeline.tasks import load_rows

    model = str(model_from_args(args))
    run_dir = Path(args.run_dir)
    data = write_dataset(run_dir.parent / "scaling.jsonl", rows=8192)
    cfg_dict = run_config(model, str(data), sampling={"max_tokens": args.max_tokens},
                          trainer={"total_steps": 10**6, "batch_size": 32, "group_size": 8, "max_staleness": 8},
                          generator={"max_inflight_groups": 96, "lease_size": 16, "max_num_seqs": 512,
                                     "gpu_memory_utilization": 0.85, "enforce_eager": bool(args.enforce_eager)})
    if args.model_size == "tiny":  # CPU smoke run: the embedded task fits the tiny model's vocabulary
        cfg_dict["data"] = {"path": "builtin:echo"}
        cfg_dict.pop("rewards")
        cfg_dict["model"]["dtype"] = "float32"
    cfg = config_from_dict(cfg_dict)
    run_dir.mkdir(parents=True, exist_ok=True)
    hub = Hub(cfg, load_rows(cfg.data), run_dir, "scaling")
    hub.start()
    consumer = Consumer(hub)
    consumer.thread.start()
    windows = []
    try:
        with Services(run_dir, cfg_dict) as svc:
            svc.address = hub.address
            for i, gpu in enumerate(args.gpus.split(",")):
                name = f"generator-{i}"
                svc.start_generator(name, gpus=gpu)
                deadline = time.monotonic() + 300
                while len(consumer.first_seen) < i + 1:  # its first group reached the hub
                    svc.check_alive()
                    assert time.monotonic() < deadline, f"{name} delivered nothing:\n{svc.tails()}"
                    time.sleep(0.2)
                time.sleep(args.warmup)
                # tokens counted as each group arrives (the hub's counter), and per generator as batches are taken
                t0, n0, per0 = time.time(), hub.counters["tokens"], dict(consumer.by_generator)
                time.sleep(args.window)
                t1, n1, per1 = time.time(), hub.counters["tokens"], dict(consumer.by_generator)
                per = {g: round((per1.get(g, 0) - per0.get(g, 0)) / (t1 - t0)) for g in per1}
                windows.append({"generators": i + 1, "gpus": args.gpus.split(",")[:i + 1], "tokens": n1 - n0,
                                "seconds": t1 - t0, "tokens_per_s": (n1 - n0) / (t1 - t0),
                                "tokens_per_s_by_generator": per})
                print(json.dumps(windows[-1]), flush=True)
    finally:
        hub.stop()
    one = windows[0]["tokens_per_s"]
    for w in windows:
        w["speedup_vs_1"] = w["tokens_per_s"] / one if one else None
    metrics = {"windows": windows, "target": "2 GPUs >= 1.9x, 3 GPUs >= 2.8x one",
               "workload": {"batch_size": 32, "group_size": 8, "max_tokens": args.max_tokens, "prompt_tokens": 32,
                            "max_inflight_groups": 96, "max_num_seqs": 512, "enforce_eager": bool(args.enforce_eager)},
               "learner": "hub + a consumer that marks each batch trained at once (no training)"}
    write_result("generator_scaling", "python -m bench.generator_scaling " + " ".join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16", metrics)


if __name__ == "__main__":
    main()
