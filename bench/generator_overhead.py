"""generator_overhead: tokens/s of our generator loop ÷ tokens/s of bare vLLM AsyncLLM, same engine and GPU.

One AsyncLLM engine, built by our `Engine` wrapper (same engine args as the service). Two ways of
driving it, alternated round by round (which goes first alternates too) with the same prompts, n and
fixed output lengths (ignore_eos):
  bare  `llm.generate` directly with the same SamplingParams, prompts pre-tokenised;
  ours  the service's per-group path, `Generator.group`: tokenise, `Engine.generate` (version gate and
        bookkeeping), decode, reward functions in a thread, pack a RolloutGroup and encode it (the
        push socket is replaced by a sink that counts bytes).
Target: ours / bare >= 0.95.

    python -m bench.generator_overhead --model-size 0.5b --gpus 1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from types import SimpleNamespace

from bench.common import generate_bare
from pipeline import protocol as P


class _Sink:
    def __init__(self):
        self.bytes = 0
        self.messages = 0

    async def send(self, data, copy: bool = False) -> None:
        self.bytes += len(data)
        self.messages += 1


async def _bare(engine, prompt_ids: list[list[int]], n: int, sampling: P.Sampling, tag: str) -> int:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=n, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        ignore_eos=True, logprobs=0, detokenize=False, stop_token_ids=[engine.eos_id],
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    return await generate_bare(engine.llm, prompt_ids, params, tag)


async def _ours(gen, session, prompts: list[str], sampling: P.Sampling, round_: int) -> int:
    items = [P.PromptItem(prompt_id=i, epoch=round_, prompt=p, columns={"answer": "1"}) for i, p in enumerate(prompts)]
    lease = P.Lease(lease_id=round_, min_version=0, groups=items, sampling=sampling)
    before = gen.tokens
    await asyncio.gather(*(gen.group(session, lease, item) for item in items))
    return gen.tokens - before


async def main(args) -> dict:
    from transformers import AutoTokenizer

    from bench.common import model_from_args, run_config, write_dataset
    from generator.engine import Engine
    from generator.engines import Fixed
    from generator.service import Generator
    from generator.session import Session
    from pipeline.config import config_from_dict
    from pipeline.tasks import encode_prompt
    from weights.base import Receiver

    model_dir = model_from_args(args)
    model = str(model_dir)
    data = write_dataset(model_dir.parent / "overhead.jsonl", rows=args.prompts, prompt_tokens=32)
    cfg = config_from_dict(run_config(model, str(data), generator={
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_num_seqs": args.max_num_seqs,
        "enforce_eager": bool(args.enforce_eager)}))
    tok = AutoTokenizer.from_pretrained(model)
    t0 = time.perf_counter()
    engine = Engine(cfg, model, seed=0, eos_id=tok.eos_token_id)
    engine_start_s = time.perf_counter() - t0
    try:
        gen = Generator(cfg, Fixed(engine, tok), "tcp://127.0.0.1:1")
        session = Session(None, SimpleNamespace(group_size=args.n, session=""), Receiver(), _Sink(), engine)
        prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
        prompt_ids = [encode_prompt(tok, cfg.data, p) for p in prompts]
        sampling = P.Sampling(max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, ignore_eos=True)
        warm = dataclasses.replace(sampling, max_tokens=16)
        await _bare(engine, prompt_ids[:32], args.n, warm, "warm")
        await _ours(gen, session, prompts[:32], warm, 10_000)
        rounds = []
        for r in range(args.rounds):  # alternating which goes first, so a drift over time favours neither
            timed = {}
            for way in (("bare", "ours") if r % 2 == 0 else ("ours", "bare")):
                t = time.perf_counter()
                if way == "bare":
                    tokens = await _bare(engine, prompt_ids, args.n, sampling, f"b{r}")
                else:
                    tokens = await _ours(gen, session, prompts, sampling, r)
                timed[way] = (tokens, time.perf_counter() - t)
            (bare_tok, bare_s), (ours_tok, ours_s) = timed["bare"], timed["ours"]
            rounds.append({"bare_tokens": bare_tok, "bare_s": bare_s, "bare_tok_s": bare_tok / bare_s,
                           "ours_tokens": ours_tok, "ours_s": ours_s, "ours_tok_s": ours_tok / ours_s,
                           "ratio": (ours_tok / ours_s) / (bare_tok / bare_s)})
            print(f"round {r}: bare {bare_tok / bare_s:.0f} tok/s, ours {ours_tok / ours_s:.0f} tok/s, "
                  f"ratio {rounds[-1]['ratio']:.3f}", flush=True)
    finally:
        engine.shutdown()  # an error above must not leave the engine's process holding the GPU
    bare = sum(x["bare_tokens"] for x in rounds) / sum(x["bare_s"] for x in rounds)
    ours = sum(x["ours_tokens"] for x in rounds) / sum(x["ours_s"] for x in rounds)
    return {"bare_tok_s": bare, "ours_tok_s": ours, "ratio": ours / bare, "target": 0.95,
            "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens, "prompt_tokens": 32,
            "max_num_seqs": args.max_num_seqs, "enforce_eager": bool(args.enforce_eager),
            "engine_start_s": engine_start_s, "rounds": rounds,
            "rollout_bytes_per_round": session.push.bytes // max(1, args.rounds + 1)}


def cli() -> None:
    from bench.common import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--gpus", default=None)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--enforce-eager", type=int, default=1, help="0: CUDA graphs")
    args = p.parse_args()
    from pipeline.config import load_config
    from pipeline.environment import apply_environment

    apply_environment(load_config(None, [f"generator.enforce_eager={bool(args.enforce_eager)}"]), args.gpus)
    metrics = asyncio.run(main(args))
    from bench.common import result_name, write_result

    name = result_name("generator_overhead", args.model_size, "eager" if args.enforce_eager else "graphs",
                       f"seqs{args.max_num_seqs}" if args.max_num_seqs != 256 else "")
    write_result(name, "python -m bench.generator_overhead " + " ".join(sys.argv[1:]),
                 f"random-weight Qwen2.5-{args.model_size} shape, bf16, enforce_eager={bool(args.enforce_eager)}",
                 metrics,
                 gpus=os.environ.get("CUDA_VISIBLE_DEVICES", ""))


if __name__ == "__main__":
    cli()
