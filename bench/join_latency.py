"""join_latency: from `pipeline generator` start to its first rollout, split into engine start and weight load.

A learner and generator A run; once the learner has published version >= 2, generator B starts (same
GPU 1, smaller memory share) and has to take the current weights before it generates. Times, from B's
process start (unix clock, same host):
  registered      the hub's `register` event: python start + tokenizer + vLLM engine start (+ handshake);
  weights_applied the hub's `weights_applied` event for B: fetch + load of the current version;
  first_rollout   the first group B delivered (hub status, polled every 50 ms).
Generator A's own start (version 0: the initial weights come with the engine) is reported too.

    python -m bench.join_latency --model-size 0.5b
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import (
    Services,
    add_model_args,
    log_times,
    model_from_args,
    result_name,
    run_config,
    write_dataset,
    write_result,
)


def _gen_id(svc: Services, pid: int) -> str | None:
    for e in svc.events("register"):
        if f"-{pid}-" in e["generator"]:
            return e["generator"]
    return None


def _timeline(svc: Services, name: str, pid: int, timeout: float) -> dict:
    t0 = svc.started[name]
    out: dict = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and "first_rollout_s" not in out:
        gid = _gen_id(svc, pid)
        if gid and "registered_s" not in out:
            out["registered_s"] = next(e["time"] for e in svc.events("register") if e["generator"] == gid) - t0
        if gid and "weights_applied_s" not in out:
            applied = [e for e in svc.events("weights_applied") if e["generator"] == gid]
            if applied:
                out["weights_applied_s"] = applied[0]["time"] - t0
                out["applied_version"] = applied[0]["version"]
                out["load_ms_reported"] = applied[0]["load_ms"]
        if gid:
            gens = {g["id"]: g for g in svc.status().get("generators", [])}
            if gens.get(gid, {}).get("groups", 0) > 0:
                out["first_rollout_s"] = time.time() - t0
        svc.check_alive()
        time.sleep(0.05)
    log = svc.run_dir / "logs" / f"{name}.log"
    for key, pattern in (("engine_ready_log_s", "registered (learner version"),
                         ("vllm_weights_loaded_log_s", "Loading weights took"),
                         ("vllm_engine_init_log_s", "init engine")):
        hits = log_times(log, pattern)
        if hits:
            out[key] = hits[0][0] - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, "join_latency")
    p.add_argument("--transport", default="auto")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    model = str(model_from_args(args))
    data = str(write_dataset(Path(args.run_dir).parent / "join.jsonl", rows=2048))
    cfg = run_config(model, data, sampling={"max_tokens": 32},
                     trainer={"total_steps": 40, "batch_size": 8, "group_size": 4, "max_staleness": 2},
                     generator={"max_inflight_groups": 8, "gpu_memory_utilization": 0.3},
                     weights={"transport": args.transport})
    if args.cpu:
        cfg["model"]["dtype"] = "float32"
    with Services(Path(args.run_dir), cfg, use_gpus=not args.cpu) as svc:
        t_learner = time.time()
        svc.start_learner()
        hub_s = time.time() - t_learner
        a = svc.start_generator("generator-a", overrides=("generator.max_inflight_groups=4",))
        first = _timeline(svc, "generator-a", a.pid, timeout=240)
        svc.wait_steps(2, timeout=240)
        b = svc.start_generator("generator-b")
        joined = _timeline(svc, "generator-b", b.pid, timeout=240)
        version_at_join = max((r["version"] for r in svc.metrics()), default=0)
    for t in (first, joined):
        if "registered_s" in t:
            t["engine_start_s"] = t["registered_s"]
            if "weights_applied_s" in t:
                t["weight_load_s"] = t["weights_applied_s"] - t["registered_s"]
            if "first_rollout_s" in t:
                t["generate_first_group_s"] = t["first_rollout_s"] - t.get("weights_applied_s", t["registered_s"])
    metrics = {"late_joiner": joined, "first_generator": first, "learner_hub_ready_s": hub_s,
               "learner_version_at_join": version_at_join, "transport": args.transport,
               "first_group": "8 samples x 32 tokens"}
    transport = "" if args.transport == "auto" else args.transport
    write_result(result_name("join_latency", args.model_size, transport, gpus=not args.cpu),
                 "python -m bench.join_latency " + " ".join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16, enforce_eager", metrics)


if __name__ == "__main__":
    main()
