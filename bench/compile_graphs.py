"""What `trainer.compile` compiles in a run's first micro-batches: the graphs torch.compile made for the decoder layers
and the seconds each micro-batch's forward and backward took, the first ones holding the compiles. The model is built
as the learner builds it (full weights, LoRA, or QLoRA's 4-bit base; learner/model.py), in fp32, in a fresh inductor
cache unless --warm: a cold start's figures. On CPU as on a GPU.

    python -m bench.compile_graphs [--model builtin:smollm2] [--lora] [--quantization 4bit] [--shapes 2x64,3x128,4x72]

Each shape is rows x length; the default's first length (64) is SmolLM2's head dimension. TORCH_LOGS=recompiles names
what compiled the layers again.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def measure(model_path: str, lora: bool, quantization: str | None, shapes: list[tuple[int, int]]) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from learner.model import compile_layers, load_quantized, quiet_dropout
    from pipeline.config import config_from_dict
    from pipeline.tinymodel import resolve_model_path

    model_section = {"path": model_path, **({"lora": {"r": 16, "alpha": 32}} if lora else {}),
                     **({"quantization": quantization} if quantization else {})}
    cfg = config_from_dict({"model": model_section, "trainer": {"compile": True}})
    path = resolve_model_path(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if quantization:
        model = load_quantized(cfg, path, torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    quiet_dropout(model)
    if cfg.model.lora is not None:
        from learner.adapters import wrap

        model = wrap(model, cfg.model.lora, torch.float32)
    model.train()
    model.config.use_cache = False
    layers = compile_layers(model)
    torch._dynamo.reset()
    counters.clear()
    steps = []
    for rows, length in shapes:
        ids = torch.randint(2, model.config.vocab_size, (rows, length), device=device)
        start = time.perf_counter()
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        steps.append({"shape": f"{rows}x{length}", "seconds": round(time.perf_counter() - start, 2),
                      "graphs_so_far": counters["stats"]["unique_graphs"]})
        print(steps[-1], flush=True)
    return {"layers": layers, "graphs": counters["stats"]["unique_graphs"], "micro_batches": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--lora", action="store_true", help="r 16, alpha 32 on every linear layer")
    ap.add_argument("--quantization", choices=["4bit", "8bit"], help="QLoRA's base (implies --lora)")
    ap.add_argument("--shapes", default="2x64,3x128,4x72,2x200")
    ap.add_argument("--warm", action="store_true", help="keep inductor's cache (default: a fresh one, a cold start)")
    ap.add_argument("--name", default="", help="added to the result's name")
    args = ap.parse_args(argv)
    if not args.warm:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    from bench.common import result_name, write_result

    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    lora = args.lora or args.quantization is not None
    metrics = measure(args.model, lora, args.quantization, shapes)  # type: ignore[arg-type]
    kind = args.quantization or ("lora" if lora else "full")
    write_result(result_name("compile_graphs", args.model.removeprefix("builtin:"), kind, args.name),
                 "python -m bench.compile_graphs " + " ".join(argv if argv is not None else sys.argv[1:]),
                 args.model, metrics, cold=not args.warm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
