"""Time to accuracy against TRL 1.16 on builtin:arith: held-out accuracy against wall time, on the same GPU.

`python -m bench.vs_trl --task arith`: ours as a user runs it against TRL 1.16's GRPOTrainer colocated at its defaults.

    ours    `pipeline run -c configs/gpu-smollm2-math.yaml` (--config), the documented command with the shipped config:
            only trainer.total_steps (--steps), trainer.max_staleness (--ks) and any --set are changed, and the result
            lists them. Its held-out curve is the run's own evaluation (eval.every, RUN_DIR/eval.jsonl).
    trl     bench/trl_grpo.py --task arith: the config's model, training rows (as JSONL, TRL's conversational form),
            reward, batch (batch_size x group_size per optimizer step), max_tokens, temperature and learning rate; the
            rest at TRL's defaults (the result holds them, and what was set); the same held-out prompts evaluated the
            same way (eval.samples at eval.temperature, sampling.max_tokens, pass@1 by the reward) every eval.every
            steps with TRL's colocated vLLM engine (`--trl-mode server --trl-gpus 2,3`: the trainer on GPU 2, TRL's
            vLLM server on GPU 3 with the config's max_model_len and TRL's defaults, evaluating through it;
            `--trl-mode async`: TRL's AsyncGRPOTrainer against that server, at most --trl-max-staleness steps
            off-policy).
    engine  the engine alone: vLLM's offline LLM with the config's generator settings generating a step's batch
            (batch_size prompts x group_size samples) from training prompts, --engine-rounds times: seconds a batch,
            completion tokens/s. What a step needs beyond it is the loop's own (bench/curves.py, step_breakdown).

Wall time is from each side's launch (model load and engine start count, as a user waits for them). TRL evaluates
inside its training loop; its curve is also given without those pauses (`train_wall_s`), and the comparison uses
that one. Ours evaluates in its generators beside training, so its curve includes what that costs. TRL's final
held-out accuracy (the mean of its last --final-window rounds) is the target: the first round at which each side
reaches it, from launch; the target (issue 53) is ours at most 0.3 of TRL's time. Each side is written as it ends
(vs_trl_arith_MODEL_{trl,ours_kK,engine}_MACHINE.json); a side of an earlier call (--with) or `--merge` makes the
comparison, vs_trl_arith_MODEL_MACHINE.json, and its plot in docs/.

    python -m bench.vs_trl --task arith --sides trl --steps 150 --timeout 560
    python -m bench.vs_trl --task arith --sides ours,engine --ks 0 --steps 150 --timeout 480
    python -m bench.vs_trl --task arith --sides trl --trl-mode server --trl-gpus 2,3 --steps 50
    python -m bench.vs_trl --task arith --sides trl --trl-mode async --trl-gpus 0,1 --steps 50
    python -m bench.vs_trl --task arith --merge RESULT.json ...
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import curves
from bench.common import ROOT, RUNS, machine_key, memory_peak, start_child, write_result
from pipeline.metrics import read_jsonl
from pipeline.netutil import free_port

TARGET = 0.3  # issue 53: our wall time to TRL's final held-out accuracy, over TRL's


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vs_trl --task arith", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "gpu-smollm2-math.yaml"))
    p.add_argument("--sides", default="trl,ours", help="of trl, ours, engine")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps of both (default: the config's)")
    p.add_argument("--ks", default=None, help="our trainer.max_staleness values, a run each (default: the config's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a further override of the config, for both sides (listed as a difference from it)")
    p.add_argument("--timeout", type=float, default=540, help="seconds per run")
    p.add_argument("--trl-mode", choices=["colocate", "server", "async", "none"], default="colocate",
                   help="server: TRL's vLLM server on the second of --trl-gpus (bench.vs_trl.trl_server); async: "
                   "AsyncGRPOTrainer against that server; none: no vLLM (CPU smoke)")
    p.add_argument("--trl-gpus", default=None, metavar="TRAINER[,SERVER]",
                   help="CUDA_VISIBLE_DEVICES of TRL's trainer and of its server (default: the caller's; server: 0,1)")
    p.add_argument("--trl-lr-schedule", default="constant", help="constant, as ours; linear: TRL's default")
    p.add_argument("--trl-max-staleness", type=int, default=None,
                   help="async: AsyncGRPOConfig.max_staleness (default TRL's, 4)")
    p.add_argument("--trl-gpu-memory", type=float, default=None, help="vllm_gpu_memory_utilization (TRL's default); "
                   "server, async: the server's --gpu-memory-utilization (0.9, trl vllm-serve's)")
    p.add_argument("--engine-rounds", type=int, default=5)
    p.add_argument("--final-window", type=int, default=1, help="rounds averaged for TRL's final held-out accuracy")
    p.add_argument("--with", dest="with_", nargs="+", default=[], metavar="RESULT",
                   help="side results of earlier calls to compare with this call's")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULT", help="start nothing: compare these sides")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the sides' run directories (default RUNS/vs-trl-arith/NAME: a call's runs of two names keep "
                   "both)")
    p.add_argument("--name", default="", help="result name prefix (default vs_trl_arith_MODEL)")
    args = p.parse_args(argv)
    if args.merge:
        compare([json.loads(Path(f).read_text()) for f in args.merge], args)
        return 0
    cfg = load(args)
    prefix = args.name or f"vs_trl_arith_{model_name(cfg)}"
    args.run_dir = args.run_dir or RUNS / "vs-trl-arith" / prefix
    args.run_dir.mkdir(parents=True, exist_ok=True)
    sides = [json.loads(Path(f).read_text()) for f in args.with_]
    for side in args.sides.split(","):
        if side == "trl":
            sides.append(save(f"{prefix}_trl", run_trl(args, cfg)))
        elif side == "ours":
            for k in (args.ks.split(",") if args.ks else [str(cfg.trainer.max_staleness)]):
                sides.append(save(f"{prefix}_ours_k{k}", run_ours(args, cfg, int(k))))
        elif side == "engine":
            sides.append(save(f"{prefix}_engine", run_engine(args)))
        else:
            raise SystemExit(f"--sides: {side!r} is none of trl, ours, engine")
    if any(s["metrics"]["side"] == "trl" for s in sides) and any(s["metrics"]["side"] == "ours" for s in sides):
        compare(sides, args)
    return 0 if all("error" not in s["metrics"] for s in sides) else 1


def load(args):
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides + ([f"trainer.total_steps={args.steps}"] if args.steps else []))
    if not cfg.eval.every:
        raise SystemExit(f"{args.config}: eval.every is 0; the comparison is held-out accuracy")
    if len(cfg.rewards) != 1 or cfg.rewards[0].weight != 1.0:
        raise SystemExit(f"{args.config}: one reward of weight 1 is compared with TRL, not {cfg.rewards}")
    return cfg


def model_name(cfg) -> str:
    return {"builtin:smollm2": "smollm2", "builtin:tiny": "tiny"}.get(cfg.model.path, Path(cfg.model.path).name)


def save(name: str, metrics: dict) -> dict:
    command = "python -m bench.vs_trl " + " ".join(sys.argv[1:])
    path = write_result(f"{name}_{machine_key()}", command, metrics.get("model", ""), metrics, quiet=True)
    print(f"{metrics['side']}: {json.dumps({k: v for k, v in metrics.items() if k in SHOWN})} -> {path}", flush=True)
    return json.loads(path.read_text())


SHOWN = ("k", "final", "steps", "returncode", "cut", "wall_s", "steps_per_min", "tokens_per_s", "batch_s", "error")


def run_trl(args, cfg) -> dict:
    """bench/trl_grpo.py --task arith on the config's workload, its held-out rounds as they came."""
    from pipeline.tasks import load_eval_rows, load_rows
    from pipeline.tinymodel import resolve_model_path

    d = args.run_dir / "trl"
    d.mkdir(parents=True, exist_ok=True)
    data, heldout, evals, out = d / "train.jsonl", d / "heldout.jsonl", d / "eval.jsonl", d / "trl.json"
    data.write_text("".join(json.dumps(r) + "\n" for r in load_rows(cfg.data)))
    heldout.write_text("".join(json.dumps(r) + "\n" for r in load_eval_rows(cfg)[:cfg.eval.max_prompts]))
    for f in (evals, out):
        f.unlink(missing_ok=True)
    t, e = cfg.trainer, cfg.eval
    served = args.trl_mode in ("server", "async")  # a vLLM server on the second of --trl-gpus
    argv = [sys.executable, "-m", "bench.trl_grpo", "--task", "arith", "--model", resolve_model_path(cfg.model.path),
            "--data", str(data), "--eval-data", str(heldout), "--eval-out", str(evals), "--out", str(out),
            "--steps", str(t.total_steps), "--batch-size", str(t.batch_size), "--group-size", str(t.group_size),
            "--max-tokens", str(cfg.sampling.max_tokens), "--temperature", str(cfg.sampling.temperature),
            "--lr", str(t.lr), "--lr-schedule", args.trl_lr_schedule, "--reward", cfg.rewards[0].fn,
            "--eval-every", str(e.every), "--eval-samples", str(e.samples), "--eval-temperature", str(e.temperature),
            "--pass-threshold", str(e.pass_threshold), "--mode", args.trl_mode, "--seed", str(t.seed),
            *(["--gpu-memory", str(args.trl_gpu_memory)] if args.trl_gpu_memory is not None and not served else []),
            *(["--max-staleness", str(args.trl_max_staleness)] if args.trl_max_staleness is not None else []),
            *trl_adapters(cfg.model)]
    gpus = (args.trl_gpus or ("0,1" if served else "")).split(",")
    env = {"CUDA_VISIBLE_DEVICES": gpus[0]} if gpus[0] else {}
    server, server_s = None, None
    if served:
        from bench.vs_trl import NO_MULTICAST, trl_server

        port = free_port()
        argv += ["--server-port", str(port)]
        env |= NO_MULTICAST
        try:
            server, server_s = trl_server(resolve_model_path(cfg.model.path), port, gpus[1], d / "trl-vllm-serve.log",
                                          max_model_len=cfg.generator.max_model_len,
                                          gpu_memory=args.trl_gpu_memory or 0.9)
        except RuntimeError as err:
            return {"side": "trl", "error": str(err), "command": " ".join(argv[1:])}
    stop, server_peak = threading.Event(), [0]
    if served:  # the server's GPU, every process on it (NVML), as supervised does the trainer's
        threading.Thread(target=memory_peak, args=(stop, server_peak, int(gpus[1])), daemon=True).start()
    try:
        code, wall, peak, child = supervised("trl-grpo", argv, d / "trl-grpo.log", args.timeout, env or None)
    finally:
        stop.set()
        if server is not None:
            server.stop(grace=10)
    result = json.loads(out.read_text()) if out.exists() else {}
    rounds = result.get("eval") or read_jsonl(evals)  # a cut run: the rounds it finished
    # what TRL's server refused (TRL 1.16's QLoRA trainer sent it 4-bit packed weights, then waited forever)
    refused = server_errors(d / "trl-vllm-serve.log") if served and (code != 0 or not out.exists()) else []
    if not rounds:
        return {"side": "trl", "error": f"exit {code}: {child.tail(30)}", "server_errors": refused,
                "command": " ".join(argv[1:])}
    launched = wall[0]
    paused, points = 0.0, []
    for r in sorted(rounds, key=lambda r: r["version"]):
        points.append({"version": r["version"], "pass@1": round(r["eval/pass@1"], 4),
                       "reward_mean": round(r["eval/reward_mean"], 4), "wall_s": round(r["time"] - launched, 2),
                       "train_wall_s": round(r["time"] - launched - paused, 2),
                       "since_train_start_s": round(r["time"] - r.get("train_started_at", launched) - paused, 2),
                       "eval_s": round(r["eval_s"], 2)})
        paused += r["eval_s"]
    result.pop("log", None)
    result.pop("eval", None)
    trl = result.pop("trl", {})
    return {"side": "trl", "model": resolve_model_path(cfg.model.path), "model_name": model_name(cfg),
            "command": "python " + " ".join(argv[1:]), "returncode": code, "cut": code is None,
            "wall_s": wall[1] - wall[0], "gpu_memory_peak_gib": peak, "curve": points,
            "final": curves.final(points, args.final_window), "steps": result.get("steps", points[-1]["version"]),
            "steps_per_min": result.get("steps_per_min"), "generation_s": result.get("generation_s"),
            "training_s": result.get("training_s"), "server_ready_s": server_s,
            "server_gpu_memory_peak_gib": server_peak[0] / 2**30 if served else None, "server_errors": refused,
            "trl": trl, "run": result}


def server_errors(log: Path, most: int = 4) -> list[str]:
    """The distinct exceptions a vLLM server's log names (`AssertionError`, `RuntimeError: ...`), in order."""
    found: list[str] = []
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in lines:
        m = re.search(r"(?:^|\] |\) )(\w*(?:Error|Exception)\b(?::.*)?)$", line.strip())
        if m and "Traceback" not in line and m.group(1) not in found:
            found.append(m.group(1))
    return found[:most]


def trl_adapters(model) -> list[str]:
    """bench/trl_grpo.py's options for the config's model.lora and model.quantization: TRL trains what ours does."""
    if model.lora is None:
        return []
    lora = model.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else "+".join(lora.target_modules)
    return ["--lora", f"{lora.r},{lora.alpha},{targets}",
            *(["--quantization", model.quantization] if model.quantization else [])]


def run_ours(args, cfg, k: int) -> dict:
    """`pipeline run -c CONFIG` with total_steps, max_staleness k and --set, as a user runs it."""
    from pipeline.tinymodel import resolve_model_path

    d = args.run_dir / f"ours-k{k}"
    if d.exists():
        import shutil

        shutil.rmtree(d)  # a run directory holds one run
    d.mkdir(parents=True)
    sets = [*args.overrides, f"trainer.total_steps={cfg.trainer.total_steps}", f"trainer.max_staleness={k}"]
    argv = [sys.executable, "-m", "pipeline", "run", "-c", args.config, "--run-dir", str(d / "run")]
    for s in sets:
        argv += ["--set", s]
    code, wall, peak, child = supervised(f"ours-k{k}", argv, d / "run.log", args.timeout)
    run = d / "run"
    records, events = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "events.jsonl")
    points = curves.eval_curve(run, launched_at=wall[0])
    if not points:
        return {"side": "ours", "k": k, "error": f"exit {code}: {child.tail(30)}", "command": " ".join(argv[1:])}
    t = cfg.trainer
    return {"side": "ours", "k": k, "model": resolve_model_path(cfg.model.path), "model_name": model_name(cfg),
            "command": f"pipeline run -c {args.config} " + " ".join(f"--set {s}" for s in sets),
            "differs_from_config": sets, "returncode": code, "cut": code is None, "wall_s": wall[1] - wall[0],
            "gpu_memory_peak_gib": peak, "curve": points, "final": curves.final(points, args.final_window),
            "steps": len(records), "breakdown": curves.step_breakdown(records, events,
                                                                      samples_per_step=t.batch_size * t.group_size),
            "health": curves.health(records), "config": cfg.to_dict()}


def run_engine(args) -> dict:
    """The engine alone, in a child process (its GPU memory is its own): `engine_child`."""
    d = args.run_dir / "engine"
    d.mkdir(parents=True, exist_ok=True)
    out = d / "engine.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "bench.vs_trl_arith", "--engine-child", str(out), "--config", args.config,
            "--rounds", str(args.engine_rounds), *[x for s in args.overrides for x in ("--set", s)]]
    code, wall, peak, child = supervised("engine-alone", argv, d / "engine.log", args.timeout)
    if not out.exists():
        return {"side": "engine", "error": f"exit {code}: {child.tail(30)}"}
    return {"side": "engine", "returncode": code, "gpu_memory_peak_gib": peak} | json.loads(out.read_text())


def supervised(name: str, argv: list[str], log: Path, timeout: float, env: dict | None = None):
    """Run a child to its end or `timeout` (then stopped; returncode None), its GPU memory peak (NVML) alongside:
    (returncode, (launch, end) unix times, peak GiB, child)."""
    stop, peak = threading.Event(), [0]
    gpu = int((env or {}).get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    threading.Thread(target=memory_peak, args=(stop, peak, gpu), daemon=True).start()
    launched = time.time()
    child = start_child(name, argv, log, env)
    try:
        code = child.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        child.stop(grace=15)
        stop.set()
    return code, (launched, time.time()), peak[0] / 2**30, child


def engine_child(argv: list[str]) -> int:
    """vLLM's offline engine with the config's generator settings, generating one step's batch of training prompts
    per round (the first round warms it and is not timed)."""
    p = argparse.ArgumentParser()
    p.add_argument("--engine-child", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    from pipeline.config import load_config
    from pipeline.environment import apply_environment

    cfg = load_config(args.config, args.overrides)
    apply_environment(cfg)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from generator.engine import compilation_args
    from pipeline.tasks import encode_prompt, load_rows
    from pipeline.tinymodel import resolve_model_path

    model, g, t = resolve_model_path(cfg.model.path), cfg.generator, cfg.trainer
    tok = AutoTokenizer.from_pretrained(model)
    rows = load_rows(cfg.data)
    llm = LLM(model=model, dtype=cfg.model.dtype, seed=0, max_model_len=g.max_model_len,
              gpu_memory_utilization=g.gpu_memory_utilization, enforce_eager=g.enforce_eager,
              logprobs_mode="processed_logprobs", **({"max_num_seqs": g.max_num_seqs} if g.max_num_seqs else {}),
              **compilation_args(g))
    s = cfg.sampling
    params = SamplingParams(n=t.group_size, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                            ignore_eos=s.ignore_eos, logprobs=0, detokenize=False)
    seconds, tokens = [], []
    for r in range(args.rounds + 1):
        batch = rows[(r * t.batch_size) % len(rows):][:t.batch_size]
        prompts = [{"prompt_token_ids": encode_prompt(tok, cfg.data, row[cfg.data.prompt_column])} for row in batch]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if r:  # the first round compiles and warms
            seconds.append(time.perf_counter() - start)
            tokens.append(sum(len(o.token_ids) for out in outs for o in out.outputs))
    Path(args.engine_child).write_text(json.dumps({
        "batch_s": curves._median(seconds), "rounds_s": [round(x, 3) for x in seconds],
        "completion_tokens_per_batch": curves._median(tokens), "tokens_per_s": sum(tokens) / sum(seconds),
        "settings": {"batch_size": t.batch_size, "group_size": t.group_size, "max_tokens": s.max_tokens,
                     "temperature": s.temperature, "dtype": cfg.model.dtype, "max_num_seqs": g.max_num_seqs,
                     "gpu_memory_utilization": g.gpu_memory_utilization, "enforce_eager": g.enforce_eager,
                     "compile": g.compile, "max_model_len": g.max_model_len,
                     "engine": "vllm.LLM (offline), initial weights"}}))
    return 0


def compare(records: list[dict], args) -> None:
    """The comparison of the sides in `records` (result files): curves, TRL's final held-out accuracy and each
    side's wall time to it, our step's breakdown against the engine alone, the differences; plot in docs/."""
    sides = [r["metrics"] | {"machine": r["machine"], "date": r["date"]} for r in records]
    trl = next((s for s in reversed(sides) if s["side"] == "trl" and "error" not in s), None)
    ours = {f"k{s['k']}": s for s in sides if s["side"] == "ours" and "error" not in s}
    engine = next((s for s in reversed(sides) if s["side"] == "engine" and "error" not in s), None)
    if trl is None or not ours:
        raise SystemExit("compare: needs a TRL side and one of ours without errors")
    target = curves.final(trl["curve"], args.final_window)
    hit = curves.reach(trl["curve"], target, args.final_window)
    trl_time = hit["train_wall_s"] if hit else None
    out = {"target_accuracy": target, "final_window": args.final_window,
           "trl": {"final": target, "wall_to_final_s": trl_time, "wall_to_final_with_evals_s": hit and hit["wall_s"],
                   "wall_total_s": trl["curve"][-1]["train_wall_s"], "steps": trl["steps"], "cut": trl.get("cut")}}
    for key, s in ours.items():
        ours_hit = curves.reach(s["curve"], target, args.final_window)
        b = s.get("breakdown") or {}
        if engine and b.get("completion_tokens_per_step"):  # the engine alone at this step's tokens
            b["engine_alone_s"] = b["completion_tokens_per_step"] / engine["tokens_per_s"]
            b["beyond_engine_s"] = b["period_s"] - b["engine_alone_s"]
        out[key] = {"final": s["final"], "reached": ours_hit is not None, "version": ours_hit and ours_hit["version"],
                    "wall_to_trl_final_s": ours_hit and ours_hit["wall_s"],
                    "of_trl": ours_hit["wall_s"] / trl_time if ours_hit and trl_time else None,
                    "met": bool(ours_hit and trl_time and ours_hit["wall_s"] <= TARGET * trl_time)}
    best = min((v["of_trl"] for k, v in out.items() if k.startswith("k") and v["of_trl"]), default=None)
    out["best_of_trl"], out["target"] = best, f"<= {TARGET:.3f} of TRL's wall time to its final held-out accuracy"
    hosts = {s["machine"]["host"] for s in sides}
    name = (args.name or f"vs_trl_arith_{trl.get('model_name', 'model')}") + f"_{_key(trl)}"
    plot(trl, ours, target, ROOT / "docs" / f"{name}.png")
    write_result(name, "python -m bench.vs_trl " + " ".join(sys.argv[1:]), trl["model"],
                 {"time_to_accuracy": out, "trl": trl, "ours": ours, "engine": engine,
                  "differences": differences(trl, next(iter(ours.values())))},
                 same_machine=len(hosts) == 1, sides=[{"side": s["side"], "k": s.get("k"), "date": s["date"],
                                                      "host": s["machine"]["host"]} for s in sides],
                 plot=f"docs/{name}.png")


def _key(side: dict) -> str:
    gpus = side["machine"]["gpus"]
    if not gpus:
        return f"cpu{side['machine']['cpus']}"
    return f"{gpus[0].split(',')[0].removeprefix('NVIDIA ').split()[0].lower()}x{len(gpus)}"


def differences(trl: dict, ours: dict) -> list[str]:
    """What differs between the two runs beyond what the comparison set equal."""
    used, c = trl.get("trl", {}).get("used", {}), ours["config"]
    t, g = c["trainer"], c["generator"]
    return [
        f"loss: ours {t['loss']} (clip {t['clip_eps']}, is_cap {t['is_cap']}, minibatches {t['minibatches']}); TRL "
        f"{used.get('loss_type')} (epsilon {used.get('epsilon')}, num_iterations {used.get('num_iterations')})",
        f"train-inference correction: ours the loss's; TRL vllm_importance_sampling_correction "
        f"{used.get('vllm_importance_sampling_correction')} ({used.get('vllm_importance_sampling_mode')}, clip max "
        f"{used.get('vllm_importance_sampling_clip_max')})",
        f"staleness: ours max_staleness {ours['k']}; TRL " + (
            f"AsyncGRPOTrainer, max_staleness {used['max_staleness']}" if used.get("max_staleness") is not None
            else "on-policy (one generation per optimizer step)"),
        f"KL: ours kl_coef {t['kl_coef']}; TRL beta {used.get('beta')}",
        f"advantages: ours scale_rewards {t['scale_rewards']}; TRL scale_rewards {used.get('scale_rewards')}",
        f"precision: ours {c['model']['dtype']} weights (fp32 optimizer states); TRL fp32 weights, bf16 "
        f"{used.get('bf16')} autocast",
        f"micro-batch: ours {t['micro_batch_tokens']} tokens; TRL {used.get('per_device_train_batch_size')} "
        f"completions; gradient checkpointing ours {t['gradient_checkpointing']}, TRL "
        f"{used.get('gradient_checkpointing')}",
        f"optimizer: ours AdamW lr {t['lr']} constant, weight decay {t['weight_decay']}, clip {t['grad_clip']}; TRL "
        f"{used.get('optim')} lr {used.get('learning_rate')} {used.get('lr_scheduler_type')}, weight decay "
        f"{used.get('weight_decay')}, clip {used.get('max_grad_norm')}",
        f"engine: ours gpu_memory_utilization {g['gpu_memory_utilization']}, max_num_seqs {g['max_num_seqs']} (0: "
        f"vLLM's default), enforce_eager {g['enforce_eager']}; TRL vllm_gpu_memory_utilization "
        f"{used.get('vllm_gpu_memory_utilization')}, max_num_seqs = the batch, max_num_batched_tokens 4096",
        "evaluation: ours in the generators beside training (its cost inside our curve); TRL's pauses training "
        "(left out of train_wall_s, the time compared)",
        "data order: each side shuffles the same training rows with its own seed",
    ]


def plot(trl: dict, ours: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([p["train_wall_s"] for p in trl["curve"]], [p["pass@1"] for p in trl["curve"]], marker=".", color="k",
            label="TRL 1.16 (evaluation pauses left out)")
    ax.plot([p["wall_s"] for p in trl["curve"]], [p["pass@1"] for p in trl["curve"]], color="k", alpha=0.3, ls=":",
            label="TRL, as measured")
    for i, (key, s) in enumerate(sorted(ours.items())):
        pts = [p for p in s["curve"] if p["wall_s"] is not None]
        ax.plot([p["wall_s"] for p in pts], [p["pass@1"] for p in pts], marker=".", color=f"C{i}",
                label=f"ours, {key.replace('k', 'k=')}")
    ax.axhline(target, color="grey", lw=0.8, ls="--", label="TRL's final held-out accuracy")
    ax.set_xlabel("wall time from launch (s)")
    ax.set_ylabel("held-out pass@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _main() -> int:
    if "--engine-child" in sys.argv:
        return engine_child(sys.argv[1:])
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(_main())
