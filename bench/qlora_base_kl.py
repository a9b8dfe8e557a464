"""Which base a QLoRA run's engine should serve: the train-inference mismatch between the learner's quantized base
and the checkpoint's own weights, on SmolLM2-135M-Instruct (builtin:smollm2), on CPU.

The learner of a model.quantization run computes with W' (each quantized weight dequantized: pipeline/quantization.py).
An engine that served the checkpoint's W instead (what merging an adapter into the original weights gives) samples
from another policy. This measures that gap as the runs report it: completions of builtin:arith's prompts sampled at
temperature 1 from the W model (the engine's, the behaviour), and the k3 estimate of KL(behaviour || learner) per
completion token, with learner W' (mismatch/kl's estimator), in fp32. The engine of this project serves W' (the gap
is then the kernels' alone: 1e-11 per token in fp32 on CPU, 2e-3 in bf16 on an H200; docs/figures.md).

    python -m bench.qlora_base_kl --prompts 8 --tokens 48
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import result_name, write_result


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import DataConfig
    from pipeline.quantization import dequantized_model
    from pipeline.tasks import arith_rows, encode_prompt
    from pipeline.tinymodel import resolve_model_path

    path = resolve_model_path("builtin:smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = arith_rows(args.prompts, seed=0)
    out = {}
    for quantization in ("4bit", "8bit"):
        learner = dequantized_model(path, quantization, torch.float32).eval()
        torch.manual_seed(0)
        total, tokens = 0.0, 0
        for row in rows:
            ids = torch.tensor([encode_prompt(tok, DataConfig(), row["prompt"])])
            with torch.no_grad():
                seq = plain.generate(ids, max_new_tokens=args.tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                       top_k=0, pad_token_id=tok.eos_token_id)
                done = seq[:, ids.shape[1]:]
                at = torch.arange(ids.shape[1] - 1, seq.shape[1] - 1)
                lp_learner = learner(seq).logits[0, at].log_softmax(-1).gather(-1, done[0, :, None])[:, 0]
                lp_served = plain(seq).logits[0, at].log_softmax(-1).gather(-1, done[0, :, None])[:, 0]
            x = (lp_learner - lp_served).double()
            total += float((torch.exp(x) - 1 - x).sum())
            tokens += done.shape[1]
        out[quantization] = {"kl_served_checkpoint_weights": total / tokens, "tokens": tokens}
        print(quantization, out[quantization], flush=True)
    write_result(result_name("qlora_base_kl", "smollm2", gpus=False),
                 "python -m bench.qlora_base_kl " + " ".join(argv), "SmolLM2-135M-Instruct (fp32)", out)


if __name__ == "__main__":
    main(sys.argv[1:])
