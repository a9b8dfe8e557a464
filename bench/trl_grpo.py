"""TRL's GRPOTrainer, for bench.vs_trl, in one of two forms.

`--task parity` (the default): the workload of bench.vs_trl's throughput comparison, at TRL's fastest settings for
it: one process, bf16, vLLM generation (`--mode colocate`: in the trainer's process; `server`: a `trl vllm-serve`
the caller started), no KL term (beta 0, so no reference model), no importance-sampling correction, one iteration
per batch, 32 completions per micro-batch, `ignore_eos` so every completion has exactly --max-tokens tokens. The
reward is bench.common.parity_reward, as on our side.

`--task arith`: time to accuracy. GRPOConfig at TRL's defaults but for what must match our run (bench/vs_trl.py,
`--task arith`): the model directory, the training rows (--data: JSONL in TRL's conversational form), the reward
(--reward), the batch (--batch-size prompts x --group-size completions per optimizer step: TRL's default micro-batch
of 8 completions, gradient accumulation over the rest, one generation per step), --max-tokens, the sampling
temperature, the learning rate, held constant as ours is (`--lr-schedule linear` for TRL's own default), vLLM
colocated (`--mode server`: a `trl vllm-serve` the caller started). A callback evaluates the held-out rows
(--eval-data) at step 0, every --eval-every steps and at the last: --eval-samples samples per prompt at
--eval-temperature with the trainer's vLLM engine, colocated or the server (its weights synced first, as TRL's next
generation would), scored by the same reward through pipeline.tasks.score as our hub scores
them; pass@1 is the share of samples whose reward reaches --pass-threshold. Each round is appended to --eval-out
as it ends (unix time when the weights were made, the evaluation's seconds), so a run cut short keeps its curve.

Both forms write steps/min, seconds per step (after --skip warm-up steps; without the evaluations) and their split
into generation (`_generate_and_score_completions`: weight sync, vLLM, rewards) and the rest (training) to --out as
JSON, with TRL's defaults of the settings that matter and what was set. Needs trl (and accelerate, datasets), which
the project does not install: bench.vs_trl says how to bring them.

    python -m bench.trl_grpo --model DIR --data JSONL --steps 12 --mode colocate --out trl.json
    python -m bench.trl_grpo --task arith --model DIR --data TRAIN.jsonl --eval-data HELDOUT.jsonl --eval-every 10 \
        --batch-size 16 --group-size 8 --max-tokens 256 --lr 1e-5 --steps 100 --eval-out eval.jsonl --out trl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.time()  # the process's start, near enough (before the heavy imports): wall time from launch

# GRPOConfig's fields recorded with every result: TRL's default, and the value the run used
RECORDED = ("learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm",
            "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "beta", "loss_type", "scale_rewards", "epsilon",
            "epsilon_high", "num_iterations", "temperature", "top_p", "top_k", "max_completion_length",
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "generation_batch_size",
            "steps_per_generation", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length",
            "vllm_enable_sleep_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max", "mask_truncated_completions", "gradient_checkpointing", "bf16",
            "shuffle_dataset", "seed", "logging_steps", "save_strategy", "model_init_kwargs", "disable_dropout")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=["parity", "arith"], default="parity")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSONL with a `prompt` column (bench.common.write_dataset; arith: "
                   "conversational rows with their reward's columns)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the timing")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per optimizer step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=32, help="parity: completions per forward/backward")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr-schedule", default="constant", help="arith: lr_scheduler_type (constant: ours; TRL's "
                   "default is linear, to 0 at --steps)")
    p.add_argument("--seed", type=int, default=None, help="arith: GRPOConfig.seed (default: TRL's)")
    p.add_argument("--reward", default="pipeline.tasks:math_answer", help="arith: module:function")
    p.add_argument("--eval-data", default=None, help="arith: JSONL of the held-out rows")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--eval-temperature", type=float, default=1.0)
    p.add_argument("--pass-threshold", type=float, default=1.0)
    p.add_argument("--eval-out", default=None, help="arith: JSONL, a line per evaluation round as it ends")
    p.add_argument("--mode", choices=["colocate", "server", "none"], default="colocate",
                   help="vLLM in the trainer's process, a trl vllm-serve, or no vLLM (a CPU smoke run)")
    p.add_argument("--gpu-memory", type=float, default=None, help="colocate: vLLM's share of the GPU (default: "
                   "parity 0.35, arith TRL's)")
    p.add_argument("--server-port", type=int, default=8000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch
    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    config, settings = (arith_config if args.task == "arith" else parity_config)(args, cuda, GRPOConfig)
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward_fn(args), args=config,
                          train_dataset=load_dataset("json", data_files=args.data, split="train"))
    clock = Clock(trainer)
    trainer.add_callback(as_callback(clock))  # before the evaluation's: a step's end is taken before it evaluates
    evaluation = None
    if args.task == "arith" and args.eval_data:
        evaluation = HeldOut(trainer, args)
        trainer.add_callback(as_callback(evaluation))
    train_start = time.time()
    trainer.train()
    out = clock.summary(args.skip, evaluation) | {
        "wall_s": time.time() - train_start, "started_at": STARTED, "train_started_at": train_start,
        "peak_gpu_gib_trainer_process": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "settings": settings,
        "trl": {"version": _version(), "defaults": defaults(GRPOConfig),
                "used": {k: _plain(getattr(config, k, None)) for k in RECORDED}},
        "log": [{k: v for k, v in rec.items() if isinstance(v, (int, float))} for rec in trainer.state.log_history]}
    if evaluation is not None:
        out["eval"] = evaluation.records
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("log", "trl", "eval")}), flush=True)
    return 0


def parity_config(args, cuda: bool, GRPOConfig):
    completions = args.batch_size * args.group_size
    gpu_memory = 0.35 if args.gpu_memory is None else args.gpu_memory
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=max(1, completions // args.micro_batch), num_generations=args.group_size,
        max_completion_length=args.max_tokens, bf16=cuda, use_cpu=not cuda, beta=0.0, num_iterations=1,
        temperature=1.0, generation_kwargs={"ignore_eos": True} if args.mode != "none" else None,
        use_vllm=args.mode != "none", vllm_mode=args.mode if args.mode != "none" else "colocate",
        vllm_gpu_memory_utilization=gpu_memory, vllm_server_port=args.server_port,
        vllm_importance_sampling_correction=False, gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, dataloader_num_workers=0,
    )
    return config, {"mode": args.mode, "prompts_per_step": args.batch_size, "group_size": args.group_size,
                    "micro_batch": args.micro_batch, "max_tokens": args.max_tokens, "lr": args.lr,
                    "vllm_gpu_memory_utilization": gpu_memory, "bf16": cuda, "beta": 0.0,
                    "importance_sampling_correction": False, "ignore_eos": args.mode != "none",
                    "gradient_checkpointing": False}


def arith_config(args, cuda: bool, GRPOConfig):
    """TRL's defaults but for what must match ours (returned as `settings["set"]`, with why)."""
    completions = args.batch_size * args.group_size
    micro = GRPOConfig.__dataclass_fields__["per_device_train_batch_size"].default  # TRL's micro-batch
    if completions % micro:
        micro = args.group_size
    set_ = {
        "max_steps": args.steps, "learning_rate": args.lr, "lr_scheduler_type": args.lr_schedule,
        "num_generations": args.group_size, "gradient_accumulation_steps": completions // micro,
        "per_device_train_batch_size": micro, "max_completion_length": args.max_tokens,
        "temperature": args.temperature, "use_vllm": args.mode != "none",
        "save_strategy": "no", "report_to": "none",
    }
    if args.mode != "none":
        set_["vllm_mode"] = args.mode
    if args.mode == "server":
        set_["vllm_server_port"] = args.server_port
    if args.gpu_memory is not None:
        set_["vllm_gpu_memory_utilization"] = args.gpu_memory
    if args.seed is not None:
        set_["seed"] = args.seed
    if not cuda:  # a CPU smoke run
        set_.update(use_cpu=True, bf16=False)
    config = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), **set_)
    why = {"max_steps": "the run's length", "learning_rate": "ours", "lr_scheduler_type": "ours is constant",
           "num_generations": "group size", "gradient_accumulation_steps": "batch: prompts x group per optimizer "
           "step, one generation per step", "per_device_train_batch_size": "TRL's default unless the batch is no "
           "multiple of it", "max_completion_length": "ours", "temperature": "ours", "use_vllm": "vLLM generates",
           "vllm_mode": "--mode", "vllm_server_port": "the trl vllm-serve started beside it",
           "save_strategy": "no checkpoints (ours saves one at the end)",
           "report_to": "no trackers"}
    return config, {"task": "arith", "mode": args.mode, "set": {k: _plain(v) for k, v in set_.items()},
                    "why": {k: why.get(k, "") for k in set_}, "prompts_per_step": args.batch_size,
                    "group_size": args.group_size, "max_tokens": args.max_tokens, "lr": args.lr,
                    "reward": args.reward}


def reward_fn(args):
    if args.task == "parity":
        from bench.common import parity_reward

        def reward(prompts, completions, completion_ids=None, **kw):
            return parity_reward(prompts, completions, completion_ids, **kw)

        return reward
    from pipeline.tasks import load_callable

    return load_callable(args.reward, "--reward")


def as_callback(hooks):
    """A transformers TrainerCallback calling `hooks.train_begin(state)` and `hooks.step_end(state)` (TrainerCallback
    is imported here, late, as the heavy libraries are)."""
    from transformers import TrainerCallback

    class Hook(TrainerCallback):
        def on_train_begin(self, args, state, control, **_):
            if hasattr(hooks, "train_begin"):
                hooks.train_begin(state)

        def on_step_end(self, args, state, control, **_):
            hooks.step_end(state)

    return Hook()


class Clock:
    """Each step's end, and each step's generation seconds (weight sync, vLLM, rewards, advantages)."""

    def __init__(self, trainer):
        self.times: list[float] = []
        self.generation: list[float] = []
        generate = trainer._generate_and_score_completions

        def timed_generate(*a, **kw):
            start = time.perf_counter()
            try:
                return generate(*a, **kw)
            finally:
                self.generation.append(time.perf_counter() - start)

        trainer._generate_and_score_completions = timed_generate

    def step_end(self, state) -> None:
        self.times.append(time.perf_counter())

    def summary(self, skip: int, evaluation=None) -> dict:
        """Steps/min over the steps after `skip`, an evaluation's seconds (run inside a step's end) left out."""
        paused = evaluation.paused if evaluation is not None else {}
        periods = [b - a - paused.get(i + 1, 0.0) for i, (a, b) in enumerate(zip(self.times, self.times[1:],
                                                                                  strict=False))]
        timed = periods[skip:]
        gen = self.generation[skip + 1:len(self.times)]  # generation[j]: step j + 1's
        if not timed or not gen:  # too few steps to time
            return {"steps": len(self.times), "steps_per_min": None, "eval_s_total": sum(paused.values())}
        step_s, gen_s = sum(timed) / len(timed), sum(gen) / len(gen)
        return {"steps": len(self.times), "steps_per_min": 60 / step_s, "step_s": step_s, "generation_s": gen_s,
                "training_s": step_s - gen_s, "eval_s_total": sum(paused.values())}


class HeldOut:
    """The held-out rows evaluated as our hub does (hub/evaluation.py), with the trainer's vLLM engine."""

    def __init__(self, trainer, args):
        from transformers import AutoTokenizer

        from pipeline.config import DataConfig, RewardConfig
        from pipeline.tasks import encode_prompt, load_reward_fns

        self.trainer, self.args = trainer, args
        self.rows = [json.loads(line) for line in Path(args.eval_data).read_text().splitlines() if line.strip()]
        self.tok = AutoTokenizer.from_pretrained(args.model)
        self.prompt_ids = [encode_prompt(self.tok, DataConfig(), r["prompt"]) for r in self.rows]
        self.fns = load_reward_fns([RewardConfig(fn=args.reward)])
        self.records: list[dict] = []
        self.paused: dict[int, float] = {}  # step -> seconds the evaluation at its end held training
        self.train_started_at = time.time()

    def train_begin(self, state) -> None:
        self.train_started_at = time.time()
        self.evaluate(0)

    def step_end(self, state) -> None:
        step = state.global_step
        if step % self.args.eval_every == 0 or step >= state.max_steps:
            self.evaluate(step)

    def evaluate(self, step: int) -> None:
        import numpy as np

        from pipeline.tasks import score

        made, start = time.time(), time.perf_counter()
        completions = self._generate(step)
        rewards = []
        for row, outs in zip(self.rows, completions, strict=True):
            texts = [self.tok.decode(o, skip_special_tokens=True) for o in outs]
            columns = {k: v for k, v in row.items() if k != "prompt"}
            rewards.append(score(self.fns, row["prompt"], texts, outs, columns)[0])
        r = np.array(rewards, dtype=np.float64)
        passed = r >= self.args.pass_threshold
        seconds = time.perf_counter() - start
        self.paused[step] = seconds
        rec = {"version": step, "time": made, "train_started_at": self.train_started_at, "eval_s": seconds,
               "eval/prompts": len(r),
               "eval/reward_mean": float(r.mean()), f"eval/pass@{self.args.eval_samples}": float(passed.any(1).mean()),
               "eval/pass@1": float(passed.mean()),
               "completion_tokens_mean": float(np.mean([len(o) for outs in completions for o in outs]))}
        self.records.append(rec)
        if self.args.eval_out:
            with open(self.args.eval_out, "a") as f:
                f.write(json.dumps(rec) + "\n")
        print(f"eval at step {step}: pass@1 {rec['eval/pass@1']:.3f} ({seconds:.1f} s)", flush=True)

    def _generate(self, step: int) -> list[list[list[int]]]:
        """eval_samples completions (token ids) of each held-out prompt with the weights of `step`."""
        a, trainer = self.args, self.trainer
        if a.mode == "none":
            return self._generate_hf()
        if step and trainer._last_loaded_step != step:  # the engine holds the weights of the step's generation
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = step  # the next generation need not sync again
        if a.mode == "server":  # the trl vllm-serve that generates its batches, through TRL's own client
            ids = trainer.vllm_generation.vllm_client.generate(
                self.prompt_ids, n=a.eval_samples, temperature=a.eval_temperature, max_tokens=a.max_tokens,
                logprobs=None)["completion_ids"]
            return [ids[i * a.eval_samples:(i + 1) * a.eval_samples] for i in range(len(self.prompt_ids))]
        from vllm import SamplingParams

        params = SamplingParams(n=a.eval_samples, temperature=a.eval_temperature, max_tokens=a.max_tokens, top_p=1.0)
        outs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids} for ids in self.prompt_ids],
                                                    sampling_params=params, use_tqdm=False)
        return [[list(o.token_ids) for o in out.outputs] for out in outs]

    def _generate_hf(self) -> list[list[list[int]]]:
        """Without vLLM (CPU smoke runs): transformers' sampling."""
        import torch

        a = self.args
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        was_training, eos = model.training, self.tok.eos_token_id
        model.eval()
        out = []
        with torch.no_grad():
            for ids in self.prompt_ids:
                x = torch.tensor([ids], device=model.device)
                gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True,
                                     temperature=a.eval_temperature, max_new_tokens=a.max_tokens, top_k=0,
                                     num_return_sequences=a.eval_samples, pad_token_id=self.tok.pad_token_id or eos)
                rows = [g[len(ids):].tolist() for g in gen]
                out.append([r[:r.index(eos) + 1] if eos in r else r for r in rows])
        model.train(was_training)
        return out


def defaults(GRPOConfig) -> dict:
    """TRL's defaults (GRPOConfig's dataclass fields, before __post_init__ derives any) of RECORDED."""
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    out = {}
    for k in RECORDED:
        f = fields.get(k)
        if f is not None:
            out[k] = _plain(f.default if f.default is not dataclasses.MISSING else f.default_factory())
    return out


def _version() -> str:
    import trl

    return trl.__version__


def _plain(v):
    return v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v)


if __name__ == "__main__":
    sys.exit(main())
