"""agent_overhead: what the agent endpoint costs (issue 44): tokens/s of agents calling the OpenAI-compatible endpoint
over HTTP, against the same calls made on the engine directly.

One engine (generator/engine.py's `Engine`, the service's engine args). The endpoint way is the rollout strategy as a
run uses it (`generator.rollout: builtin:agent`, generator/agent.py): --prompts prompts x --n samples at once, each an
agent of three chat calls of exactly --call-tokens tokens (ignore_eos) with a tool's reply between them. Each call's
prompt ids and length are read back from the trajectories (`replays`); the direct way makes those calls with
`Engine.generate`, each sample's in order and the samples at once: the same tokens from the same contexts, without
HTTP, the chat template, tokenizing and the session's bookkeeping. Rounds alternate which goes first.
Target: endpoint / direct >= 0.95. --agent-workers N runs the agents in N processes of their own
(generator.agent_workers), which ask the engine for each completion; a list (0,4,8) measures each in turn on the same
engine, one result each.

    python -m bench.agent_overhead --model builtin:smollm2 --gpus 0 [--agent-workers 0,4,8]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

from pipeline import protocol as P


async def three_calls(client, item):
    """The benchmark's agent: three chat calls with a tool's reply between them."""
    messages = list(item.messages)
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=item.columns["call_tokens"])
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if turn < 2:
            messages.append({"role": "user", "content": f"tool: result {turn} for item {item.prompt_id}"})
    return messages[-1]["content"]


def replays(groups: list, prompts: list[list[int]]) -> list[list[tuple[list[int], int]]]:
    """Each sample's calls as (prompt ids, tokens sampled), read back from its trajectory: a turn's prompt is the
    context followed by every token before the turn, its length the run of model tokens from its start."""
    seqs = []
    for group, base in zip(groups, prompts, strict=True):
        for o in group:
            context = o.prompt_ids if o.prompt_ids is not None else base
            calls = []
            for start, _ in o.turns:
                end = start
                while end < len(o.mask) and o.mask[end]:
                    end += 1
                calls.append((context + o.token_ids[:start], end - start))
            seqs.append(calls)
    return seqs


async def main(args) -> list[dict]:
    """One result per count of --agent-workers, each measured with the same engine."""
    from transformers import AutoTokenizer

    from generator.agent import AgentRollout
    from generator.engine import Engine
    from generator.rollout import Context
    from pipeline.config import config_from_dict
    from pipeline.tinymodel import resolve_model_path

    model = resolve_model_path(args.model)
    budget = 3 * args.call_tokens + 64
    cfg = config_from_dict({
        "model": {"path": model, "dtype": "bfloat16" if args.gpus else "float32"},
        "sampling": {"max_tokens": budget, "ignore_eos": True},
        "generator": {"rollout": "builtin:agent", "agent": "bench.agent_overhead:three_calls",
                      "max_model_len": budget + 128, "max_num_seqs": args.max_num_seqs,
                      "enforce_eager": bool(args.enforce_eager),
                      "gpu_memory_utilization": args.gpu_memory_utilization}})
    tok = AutoTokenizer.from_pretrained(model)
    engine = Engine(cfg, model, seed=0, eos_id=tok.eos_token_id)
    sampling = P.Sampling(budget, 1.0, ignore_eos=True)
    items = [P.PromptItem(i, 0, "", messages=[{"role": "user", "content": f"Item {i}: add {i} and {2 * i}."}],
                          columns={"call_tokens": args.call_tokens}) for i in range(args.prompts)]

    prompts = [tok.apply_chat_template(it.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
               for it in items]

    async def endpoint(rollout) -> tuple[int, float, list]:
        t = time.perf_counter()
        groups = await asyncio.gather(*(rollout(engine, ids, Context(args.n, sampling, tok, it))
                                        for ids, it in zip(prompts, items, strict=True)))
        seconds = time.perf_counter() - t
        return sum(sum(o.mask) for g in groups for o in g), seconds, replays(groups, prompts)

    async def direct(seqs: list) -> tuple[int, float]:
        async def replay(calls):
            n = 0
            for prompt, length in calls:
                (out,) = await engine.generate(prompt, 1, dataclasses.replace(sampling, max_tokens=length))
                n += len(out.token_ids)
            return n

        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*(replay(calls) for calls in seqs)))
        return tokens, time.perf_counter() - t

    async def measure(workers: int) -> dict:
        rollout = AgentRollout(dataclasses.replace(cfg, generator=dataclasses.replace(cfg.generator,
                                                                                      agent_workers=workers)))
        try:
            t = time.perf_counter()
            *_, seqs = await endpoint(rollout)  # warm: the server (the workers) starts, the engine's first batches
            t2 = time.perf_counter()
            await direct(seqs)  # and the direct side's (on an H200 its first two rounds ran at 0.6 of its later ones)
            print(f"agent_workers {workers}: warmed up in {t2 - t:.0f} s (endpoint) and "
                  f"{time.perf_counter() - t2:.0f} s (direct)", flush=True)
            rounds = []
            for r in range(args.rounds):
                if r % 2:
                    d_tok, d_s = await direct(seqs)
                    e_tok, e_s, seqs = await endpoint(rollout)
                else:
                    e_tok, e_s, seqs = await endpoint(rollout)
                    d_tok, d_s = await direct(seqs)
                rounds.append({"endpoint_tok_s": e_tok / e_s, "direct_tok_s": d_tok / d_s,
                               "calls": sum(len(c) for c in seqs),
                               "endpoint_tokens": e_tok, "direct_tokens": d_tok, "endpoint_s": e_s, "direct_s": d_s,
                               "ratio": (e_tok / e_s) / (d_tok / d_s)})
                print(f"agent_workers {workers}, round {r}: endpoint {e_tok / e_s:.0f} tok/s, direct "
                      f"{d_tok / d_s:.0f} tok/s, ratio {rounds[-1]['ratio']:.3f}", flush=True)
            if args.profile:  # one more endpoint round under cProfile, after the measured ones: where this process's
                # time goes
                import cProfile
                import io
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                await endpoint(rollout)
                prof.disable()
                text = io.StringIO()
                for key in ("tottime", "cumulative"):
                    pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
                Path(f"{args.profile}.w{workers}").write_text(text.getvalue())
        finally:
            await rollout.aclose()
        e = sum(x["endpoint_tokens"] for x in rounds) / sum(x["endpoint_s"] for x in rounds)
        d = sum(x["direct_tokens"] for x in rounds) / sum(x["direct_s"] for x in rounds)
        print(f"agent_workers {workers}: ratio {e / d:.3f} over {args.rounds} rounds", flush=True)
        return {"endpoint_tok_s": e, "direct_tok_s": d, "ratio": e / d, "target": 0.95, "agent_workers": workers,
                "prompts": args.prompts, "n": args.n, "call_tokens": args.call_tokens, "calls_per_sample": 3,
                "rounds": rounds}

    try:
        return [await measure(int(w)) for w in str(args.agent_workers).split(",")]
    finally:
        engine.shutdown()


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--gpus", default=None)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--call-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--enforce-eager", type=int, default=1, help="0: CUDA graphs")
    p.add_argument("--agent-workers", default="0",
                   help="generator.agent_workers: the agents in this many processes of their own (0: on the loop); "
                        "a list (0,4,8): each in turn on the same engine")
    p.add_argument("--profile", default="", help="FILE: one more endpoint round under cProfile, its top functions, "
                   "in FILE.wN for each count N")
    args = p.parse_args()
    from pipeline.config import load_config
    from pipeline.environment import apply_environment

    apply_environment(load_config(None, [f"generator.enforce_eager={bool(args.enforce_eager)}"]), args.gpus)
    from bench.common import result_name, write_result

    for metrics in asyncio.run(main(args)):
        workers = f"w{metrics['agent_workers']}" if metrics["agent_workers"] else ""
        name = result_name("agent_overhead", args.model.split(":")[-1], workers)
        write_result(name, "python -m bench.agent_overhead " + " ".join(sys.argv[1:]), args.model, metrics)


if __name__ == "__main__":
    cli()
