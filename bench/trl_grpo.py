"""TRL's GRPOTrainer on the workload of bench.vs_trl, at TRL's fastest settings for it: one process, bf16, vLLM
generation (`--mode colocate`: in the trainer's process; `server`: a `trl vllm-serve` the caller started), no KL
term (beta 0, so no reference model), no importance-sampling correction, one iteration per batch, 32
completions per micro-batch, `ignore_eos` so every completion has exactly --max-tokens tokens. The reward is
bench.common.parity_reward, as on our side. Writes steps/min, seconds per step (after --skip warm-up steps) and
their split into generation (`_generate_and_score_completions`: weight sync, vLLM, rewards) and the rest
(training) to --out as JSON. Needs trl (and accelerate, datasets), which the project does not install:
bench.vs_trl says how to bring them.

    python -m bench.trl_grpo --model DIR --data JSONL --steps 12 --mode colocate --out trl.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSONL with a `prompt` column (bench.common.write_dataset)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the timing")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per optimizer step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=32, help="completions per forward/backward")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--mode", choices=["colocate", "server", "none"], default="colocate",
                   help="vLLM in the trainer's process, a trl vllm-serve, or no vLLM (a CPU smoke run)")
    p.add_argument("--gpu-memory", type=float, default=0.35, help="colocate: vLLM's share of the GPU")
    p.add_argument("--server-port", type=int, default=8000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.common import parity_reward

    completions = args.batch_size * args.group_size
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=max(1, completions // args.micro_batch), num_generations=args.group_size,
        max_completion_length=args.max_tokens, bf16=cuda, use_cpu=not cuda, beta=0.0, num_iterations=1,
        temperature=1.0, generation_kwargs={"ignore_eos": True} if args.mode != "none" else None,
        use_vllm=args.mode != "none", vllm_mode=args.mode if args.mode != "none" else "colocate",
        vllm_gpu_memory_utilization=args.gpu_memory, vllm_server_port=args.server_port,
        vllm_importance_sampling_correction=False, gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, dataloader_num_workers=0,
    )
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.perf_counter())

    def reward(prompts, completions, completion_ids=None, **kw):
        return parity_reward(prompts, completions, completion_ids, **kw)

    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config,
                          train_dataset=load_dataset("json", data_files=args.data, split="train"),
                          callbacks=[Clock()])
    generation: list[float] = []  # seconds of each step's generation: weight sync, vLLM, rewards, advantages
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generation.append(time.perf_counter() - start)

    trainer._generate_and_score_completions = timed_generate
    start = time.perf_counter()
    trainer.train()
    timed = times[args.skip:]
    step_s = (timed[-1] - timed[0]) / (len(timed) - 1) if len(timed) > 1 else float("nan")
    gen_s = sum(generation[args.skip + 1:len(times)]) / max(1, len(times) - args.skip - 1)  # the timed steps'
    out = {"steps": len(times), "steps_per_min": 60 / step_s, "step_s": step_s, "wall_s": time.perf_counter() - start,
           "generation_s": gen_s, "training_s": step_s - gen_s,
           "peak_gpu_gib_trainer_process": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "settings": {"mode": args.mode, "prompts_per_step": args.batch_size, "group_size": args.group_size,
                        "micro_batch": args.micro_batch, "max_tokens": args.max_tokens, "lr": args.lr,
                        "vllm_gpu_memory_utilization": args.gpu_memory, "bf16": cuda, "beta": 0.0,
                        "importance_sampling_correction": False, "ignore_eos": args.mode != "none",
                        "gradient_checkpointing": False},
           "log": [{k: v for k, v in rec.items() if isinstance(v, (int, float))} for rec in trainer.state.log_history]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "log"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
