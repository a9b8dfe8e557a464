"""engine_host: where one vLLM engine's time goes on a small model, with and without the sampled tokens'
log-probs (which every rollout asks for: the learner's importance weights need them).

One engine, built by our `Engine` wrapper (the service's engine args: vLLM's offline defaults, the
processed log-probs), alone on the GPU. For each size in --sequences (prompts x n, every completion exactly
--max-tokens long), three ways of getting the sampled tokens' log-probs, each first in turn over the rounds:
`vllm` (bare `llm.generate` with `logprobs=0`: vLLM hands them over at every step), `worker` (our
`Engine.generate`: the workers keep them and hand a group's over at its end, generator/sampled_logprobs.py) and
`none` (bare, `logprobs=None`: the floor). For each: the wall time, the CPU seconds of this process (vLLM's
output handling, as in the generator) and of the engine-core process (scheduler, sampler, model runner), and
NVML's GPU utilisation.
A core whose CPU seconds are about its wall time, on a GPU mostly idle, is host-bound: more sequences at once
then do not raise tokens/s.

    python -m bench.engine_host --gpus 0 [--sequences 256,512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

MODES = ["vllm", "worker", "none"]  # how the sampled tokens' log-probs come back (`_generate`)


def _utilisation(stop: threading.Event, samples: list[int]) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not stop.is_set():
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            time.sleep(0.05)
    except Exception:  # no NVML (CPU smoke run)
        return


def _cpu_s(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def _generate(engine, prompt_ids: list[list[int]], n: int, max_tokens: int, mode: str, tag: str) -> None:
    """`mode` vllm: bare `llm.generate`, vLLM hands the log-probs over at every step (`logprobs=0`); none: bare,
    no log-probs; worker: our `Engine.generate`, the workers keep them and hand a group's over at its end."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from bench.common import generate_bare
    from pipeline.protocol import Sampling

    if mode == "worker":
        assert await engine.keep_logprobs_in_workers(True)
        try:
            sampling = Sampling(max_tokens=max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True)
            await asyncio.gather(*(engine.generate(ids, n, sampling) for ids in prompt_ids))
        finally:
            await engine.keep_logprobs_in_workers(False)
        return
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                            logprobs=0 if mode == "vllm" else None, detokenize=False, flat_logprobs=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    await generate_bare(engine.llm, prompt_ids, params, tag)


def _said(what: str, since: float) -> float:
    """Print how long a phase of the start took (a fresh machine's run once spent 330 s before the engine built)."""
    now = time.perf_counter()
    print(f"start: {what} in {now - since:.1f} s", flush=True)
    return now


async def main(args) -> dict:
    t = time.perf_counter()
    import psutil
    from transformers import AutoTokenizer

    from bench.common import model_from_args, run_config, write_dataset
    from generator.engine import Engine
    from pipeline.config import config_from_dict
    from pipeline.tasks import encode_prompt

    t = _said("imports", t)
    model_dir = model_from_args(args)
    t = _said(f"the model at {model_dir}", t)
    sizes = [int(s) for s in args.sequences.split(",")]
    data = write_dataset(model_dir.parent / "engine_host.jsonl", rows=max(sizes) // args.n,
                         prompt_tokens=(args.prompt_tokens + 1) // 2)  # a letter and a space: 2 tokens each
    cfg = config_from_dict(run_config(str(model_dir), str(data), generator={
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_num_seqs": 0, "enforce_eager": False}))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    t = _said("the dataset and the tokenizer", t)
    engine = Engine(cfg, str(model_dir), seed=0, eos_id=tok.eos_token_id)
    t = _said("the engine", t)
    try:
        me = psutil.Process()
        core = me.children(recursive=True)  # the engine-core process (and vLLM's helpers, idle)
        prompts = [encode_prompt(tok, cfg.data, json.loads(line)["prompt"]) for line in data.read_text().splitlines()]
        await engine.keep_logprobs_in_workers(False)
        await _generate(engine, prompts[:8], args.n, 32, "vllm", "warm")
        await _generate(engine, prompts[:8], args.n, 32, "worker", "warm")
        _said("the warm-up", t)
        runs = []
        for r in range(args.rounds):
            for size in sizes:
                for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:  # each first in turn
                    stop, util = threading.Event(), []
                    sampler = threading.Thread(target=_utilisation, args=(stop, util), daemon=True)
                    sampler.start()
                    front, cores = _cpu_s(me), [_cpu_s(c) for c in core]
                    start = time.perf_counter()
                    await _generate(engine, prompts[:size // args.n], args.n, args.max_tokens, mode,
                                    f"r{r}-{size}-{mode}")
                    wall = time.perf_counter() - start
                    stop.set()
                    sampler.join()
                    run = {"sequences": size, "logprobs": mode, "wall_s": wall,
                           "tokens_per_s": size * args.max_tokens / wall,
                           "ms_per_decode_step": wall / args.max_tokens * 1000,
                           "frontend_cpu_s": _cpu_s(me) - front,
                           "core_cpu_s": max(_cpu_s(c) - s for c, s in zip(core, cores, strict=True)),
                           "gpu_util_pct": sum(util) / max(1, len(util))}
                    runs.append(run)
                    print(json.dumps(run), flush=True)
    finally:
        engine.shutdown()
    summary = {}
    for size in sizes:
        for mode in MODES:
            mine = [x for x in runs if x["sequences"] == size and x["logprobs"] == mode]
            summary[f"{size}_{mode}"] = {
                k: sum(x[k] for x in mine) / len(mine)
                for k in ("wall_s", "tokens_per_s", "frontend_cpu_s", "core_cpu_s", "gpu_util_pct")}
    return {"summary": summary, "runs": runs, "n": args.n, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "gpu_memory_utilization": args.gpu_memory_utilization}


def cli() -> None:
    from bench.common import add_model_args, result_name, write_result
    from pipeline.config import load_config
    from pipeline.environment import apply_environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--gpus", default="0")
    p.add_argument("--sequences", default="256,512", help="sequences at once: prompts x --n")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    args = p.parse_args()
    apply_environment(load_config(None, ["generator.enforce_eager=false"]), args.gpus)
    metrics = asyncio.run(main(args))
    write_result(result_name("engine_host", args.model_size), "python -m bench.engine_host " + " ".join(sys.argv[1:]),
                 "SmolLM2-135M-Instruct, bf16, CUDA graphs" if args.model_size == "smollm2" else
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16, CUDA graphs", metrics,
                 gpus=os.environ.get("CUDA_VISIBLE_DEVICES", ""))


if __name__ == "__main__":
    cli()
