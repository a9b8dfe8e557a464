"""loop_lag: how long the generator's event loop stalls while its engine generates, with vLLM's log-probs as a dict
per position (vLLM's default) and flat (`flat_logprobs`, what generator/engine.py asks for).

The loop that feeds the engine also takes weight announcements: while it stalls, a broadcast waits for this
generator. One `Engine` (the embedded tiny model on CPU, or --model-dir on a GPU), 32 groups of 8 samples x 256
tokens at once; a task on the loop sleeps 5 ms in turn and records how late it wakes; Python's garbage
collections are timed through gc.callbacks. Each setting runs in a process of its own.

    python -m bench.loop_lag [--model-dir DIR --gpus 0]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time


async def measure(flat: bool, model: str, max_tokens: int) -> dict:
    import vllm

    from pipeline import protocol as P
    from pipeline.config import config_from_dict
    from pipeline.environment import apply_environment

    if model == "builtin:tiny":  # 256 positions; 40 + 256 tokens run past them, harmless for random weights (RoPE)
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    params = vllm.SamplingParams
    vllm.SamplingParams = lambda *a, **k: params(*a, **(k | {"flat_logprobs": flat}))  # what Engine builds
    cfg = config_from_dict({"model": {"path": model}, "generator": {"max_num_seqs": 256, "max_model_len": 512,
                                                                      "cpu_kvcache_gb": 2}})
    apply_environment(cfg)
    from generator.engine import Engine
    from pipeline.tinymodel import resolve_model_path

    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def timed(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(timed)
    engine = Engine(cfg, resolve_model_path(model), 0, None)
    sampling = P.Sampling(max_tokens=max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True)
    lags, done = [], [False]

    async def tick():
        while not done[0]:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    try:
        await asyncio.gather(*(engine.generate([4, 5, 6, 3] * 8, 8, sampling) for _ in range(4)))  # warm
        ticker = asyncio.create_task(tick())
        lags.clear(), pauses.clear()
        t = time.perf_counter()
        await asyncio.gather(*(engine.generate([4, 5, 6, 3, 4 + i % 10] * 8, 8, sampling) for i in range(32)))
        seconds = time.perf_counter() - t
        done[0] = True
        await ticker
        window = list(pauses)  # not the collection of the engine's shutdown
    finally:
        engine.shutdown()
    lags.sort()
    full = [s for g, s in window if g == 2]
    return {"flat_logprobs": flat, "tokens_per_s": 32 * 8 * max_tokens / seconds,
            "loop_lag_p50_ms": lags[len(lags) // 2] * 1e3, "loop_lag_p99_ms": lags[int(len(lags) * 0.99)] * 1e3,
            "loop_lag_max_ms": lags[-1] * 1e3, "collections": len(window),
            "collections_ms": sum(s for _, s in window) * 1e3, "full_collections": len(full),
            "full_collection_max_ms": max(full, default=0.0) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="builtin:tiny")
    p.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES (default: CPU)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--one", choices=["dict", "flat"], help=argparse.SUPPRESS)  # a setting, in its own process
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(asyncio.run(measure(args.one == "flat", args.model_dir, args.max_tokens))))
        return 0
    from bench.common import RUNS, result_name, start_child, write_result

    out = {}
    for way in ("dict", "flat"):
        log = RUNS / f"loop_lag_{way}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)  # this run's alone
        child = start_child(f"loop_lag_{way}", [sys.executable, "-m", "bench.loop_lag", "--one", way, "--model-dir",
                                                args.model_dir, "--max-tokens", str(args.max_tokens)], log,
                            env={"CUDA_VISIBLE_DEVICES": args.gpus} if args.gpus is not None else None)
        try:
            child.proc.wait(900)
        except subprocess.TimeoutExpired:
            pass
        finally:
            child.stop(grace=10)
        lines = [line for line in log.read_text().splitlines() if line.startswith("RESULT ")]
        out[way] = json.loads(lines[-1][7:]) if lines else {"error": child.tail(20)}
        print(way, out[way], flush=True)
    write_result(result_name("loop_lag", "tiny" if args.model_dir == "builtin:tiny" else "model",
                             gpus=args.gpus is not None), "python -m bench.loop_lag " + " ".join(sys.argv[1:]),
                 args.model_dir, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
