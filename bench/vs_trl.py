"""Ours against TRL 1.16's GRPOTrainer, on the same GPUs and workload, in one command: a random-weight model of
Qwen2.5-0.5B's shape (bf16), 64-token prompts, exactly 256 generated tokens (`ignore_eos`), 32 prompts x 8
samples per optimizer step, lr 1e-6, the parity reward.

    --gpus 1   everything on GPU 0: TRL with vLLM colocated (`vllm_gpu_memory_utilization` 0.35) against
               `pipeline run -c configs/gpu-single.yaml` as a user runs it (bench.colocated: the config as shipped,
               only model, data, reward, workload and max_staleness set) at each k of --ks; --max-num-seqs and
               --micro-batch-tokens change it further, and the result says so (`differs_from_config`)
    --gpus 2   learner / trainer on GPU 0, vLLM on GPU 1: TRL with its vLLM server (trl_server: the `vllm serve` of
               `trl vllm-serve`, nccl weight transfer) against bench.pipeline_speedup (nccl transport, CUDA graphs,
               the learner compiled as configs/gpu-single.yaml has it) at each k of --ks

TRL's settings are its fastest for this workload (bench/trl_grpo.py says which). The result
(vs_trl_0.5b_{1,2}gpu_KS_MACHINE.json, KS one kK for each k of --ks, e.g. k1k2) holds both systems' figures and
settings, and under `vs_trl` the ratio of our steps/min to TRL's at each k and at the best k, and TRL's step split
into generation and training. The GPU memory peak is NVML's, every process on the GPU. One call of the GPU machine
may be too short for TRL and every k: `--reuse-trl` reuses TRL's figures of an earlier run on the same machine.

TRL is not a dependency of the project: on a GPU host without a package index, bring trl 1.16.0, datasets
4.8.5 and multiprocess 0.70.19 (py312) as wheels (see bench/README.md, part `vs-trl`).

    python -m bench.vs_trl --gpus 1 [--steps 30] [--ks 0,1]

`--task arith` is the other form, time to accuracy on builtin:arith with builtin:smollm2: held-out accuracy against
wall time, `pipeline run -c configs/gpu-smollm2-math.yaml` as shipped against TRL at its defaults on one GPU
(bench/vs_trl_arith.py says how; its options follow `--task arith`).

    python -m bench.vs_trl --task arith [--sides trl,ours,engine] [--steps N] [--ks 0,1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import (
    RESULTS,
    RUNS,
    add_model_args,
    memory_peak,
    model_from_args,
    result_name,
    start_child,
    write_dataset,
    write_result,
)
from pipeline.launcher import Child
from pipeline.netutil import free_port

WORKLOAD = {"batch_size": 32, "group_size": 8, "prompt_tokens": 64, "max_tokens": 256, "lr": 1e-6}
# NVLink multicast off in every child of an NCCL group (the lent GPU hosts' rule), also where a child's environment
# is built here: TRL's server and its trainer join one for the weights
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def main() -> int:
    task = argparse.ArgumentParser(add_help=False)
    task.add_argument("--task", choices=["parity", "arith"], default="parity")
    known, rest = task.parse_known_args()
    if known.task == "arith":
        from bench import vs_trl_arith

        return vs_trl_arith.main(rest)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=["parity", "arith"], default="parity", help="parity: steps/min on issue 16's "
                   "workload (below); arith: time to accuracy (bench/vs_trl_arith.py)")
    add_model_args(p, "vs-trl")
    p.add_argument("--gpus", type=int, choices=[1, 2], default=1)
    p.add_argument("--steps", type=int, default=30, help="steps per run (the first 2 are left out of the timing). At "
                   "k >= 1 the learner takes batches in runs of up to k + 1: 10 steps hold one or two such periods and "
                   "measure where the window falls (21-31 steps/min at k = 3 on one H200); 30 settle")
    p.add_argument("--ks", default="0,1", help="our max_staleness values")
    p.add_argument("--max-num-seqs", type=int, default=None, help="our generator.max_num_seqs (default: the config's)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="our trainer.micro_batch_tokens (default: configs/gpu-single.yaml's with --gpus 1, the "
                   "learner's default with --gpus 2)")
    p.add_argument("--engines-per-gpu", type=int, default=1,
                   help="with --gpus 2: our generators sharing GPU 1 (bench.pipeline_speedup's --engines-per-gpu)")
    p.add_argument("--reuse-trl", action="store_true", help="TRL's figures from an earlier run of this command "
                   "with the same --run-dir (its trl-result.json), instead of running TRL again")
    p.add_argument("--timeout", type=float, default=540, help="seconds per run")
    args = p.parse_args()
    model = str(model_from_args(args))
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = write_dataset(run_dir / "prompts.jsonl", rows=4096, prompt_tokens=(WORKLOAD["prompt_tokens"] + 1) // 2)
    # (a letter and a space: 2 tokens of the bench tokenizer as transformers loads it, as in bench.pipeline_speedup)
    if args.reuse_trl:
        trl = json.loads((run_dir / "trl-result.json").read_text()) | {"reused": True}
    else:
        trl = run_trl(args, model, data, run_dir)
        (run_dir / "trl-result.json").write_text(json.dumps(trl))
    ks = [int(k) for k in args.ks.split(",")]
    if args.gpus == 1:
        ours = {f"k{k}": run_ours(args, model, str(k))[f"k{k}"] for k in ks}
    else:  # one pipeline, k changed while it runs (a phase per k)
        ours = run_ours(args, model, args.ks)
    ratios = {k: o["steps_per_min"] / trl["steps_per_min"] for k, o in ours.items()
              if o.get("steps_per_min") and trl.get("steps_per_min")}
    if ratios:
        ratios["best"] = max(ratios.values())
    name = result_name("vs_trl", args.model_size, f"{args.gpus}gpu", _engines(args),
                       "".join(f"k{k}" for k in sorted(set(ks))))  # two calls with other --ks keep their own files
    write_result(name, "python -m bench.vs_trl " + " ".join(sys.argv[1:]), f"random-weight Qwen2.5-{args.model_size} "
                 "shape, bf16", {"trl": trl, "ours": ours, "vs_trl": ratios}, workload=WORKLOAD)
    return 0 if ratios else 1


def _engines(args) -> str:
    """The result names' tag for several of our engines on GPU 1 ("" for one, and on one GPU)."""
    return f"{args.engines_per_gpu}engines" if args.gpus == 2 and args.engines_per_gpu > 1 else ""


def trl_server(model: str, port: int, gpu: str, log: Path, max_model_len: int | None = None,
               gpu_memory: float = 0.9, timeout: float = 300) -> tuple[Child, float]:
    """TRL's vLLM server on GPU `gpu` once it answers /health: (the child, seconds to healthy).

    It is the `vllm serve` command that TRL 1.16's `trl vllm-serve` execs (trl/scripts/vllm_serve.py,
    build_command), run directly as TRL's deprecation warning asks. Both TRL trainers need its settings:
    - `--weight-transfer-config` nccl: the trainer sends its weights over NCCL (vLLM's NCCLWeightTransferEngine);
    - `VLLM_SERVER_DEV_MODE=1`: the endpoints they call for it (/pause, /resume, /init_weight_transfer_engine,
      /start_weight_update, /update_weights, /finish_weight_update, /get_world_size, /server_info);
    - `--logprobs-mode processed_logprobs`: sampled tokens' logprobs after temperature, as the trainers score them.
    Raises RuntimeError, the child stopped, if it exits or is not healthy within `timeout` seconds (cold engine
    builds take minutes)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1", "--port",
            str(port), "--gpu-memory-utilization", str(gpu_memory), "--weight-transfer-config",
            json.dumps({"backend": "nccl"}), "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
            *(["--max-model-len", str(max_model_len)] if max_model_len else [])]
    start = time.monotonic()
    server = start_child("trl-vllm-serve", argv, log, env={"CUDA_VISIBLE_DEVICES": gpu, "VLLM_SERVER_DEV_MODE": "1"}
                         | NO_MULTICAST)
    while server.proc.poll() is None and time.monotonic() - start < timeout:
        if _healthy(f"http://127.0.0.1:{port}/health"):
            return server, time.monotonic() - start
        time.sleep(1)
    server.stop(grace=10)
    raise RuntimeError(f"TRL's vLLM server never healthy (exit {server.proc.returncode} after "
                       f"{time.monotonic() - start:.0f} s): {server.tail(20)}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused while it starts, or a timeout
        return False


def run_trl(args, model: str, data: Path, run_dir: Path) -> dict:
    """TRL's trainer on GPU 0 (and with 2 GPUs, its vLLM server on GPU 1), its GPU memory peak alongside."""
    out = run_dir / "trl.json"
    out.unlink(missing_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "bench.trl_grpo", "--model", model, "--data", str(data), "--steps", str(args.steps),
            "--batch-size", str(WORKLOAD["batch_size"]), "--group-size", str(WORKLOAD["group_size"]),
            "--max-tokens", str(WORKLOAD["max_tokens"]), "--lr", str(WORKLOAD["lr"]), "--out", str(out),
            "--mode", "colocate" if args.gpus == 1 else "server", "--server-port", str(port)]
    server = None
    if args.gpus == 2:
        max_len = int(WORKLOAD["prompt_tokens"] + WORKLOAD["max_tokens"]) + 64
        try:
            server, _ = trl_server(model, port, "1", run_dir / "trl-vllm-serve.log", max_model_len=max_len)
        except RuntimeError as e:
            return {"error": str(e)}
    stop, peak = threading.Event(), [0]
    threading.Thread(target=memory_peak, args=(stop, peak), daemon=True).start()
    trainer = start_child("trl-grpo", argv, run_dir / "trl-grpo.log", env={"CUDA_VISIBLE_DEVICES": "0"} | NO_MULTICAST)
    try:
        code = trainer.proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        trainer.stop(grace=10)
        if server is not None:
            server.stop(grace=10)
        stop.set()
    result = json.loads(out.read_text()) if out.exists() else {"error": f"exit {code}: {trainer.tail(20)}"}
    result.pop("log", None)
    return result | {"gpu0_memory_peak_gib": peak[0] / 2**30}


def run_ours(args, model: str, ks: str) -> dict:
    """bench.colocated (1 GPU, one k) or bench.pipeline_speedup (2 GPUs, a phase per k) at max_staleness `ks`,
    read from its result: {"k0": figures, ...}."""
    name = "_".join(filter(None, [f"vs_trl_ours_{args.gpus}gpu_k{ks.replace(',', '')}", _engines(args)]))
    limit = args.timeout * len(ks.split(","))
    w = WORKLOAD
    common = ["--model-dir", model, "--batch-size", str(w["batch_size"]), "--group-size",
              str(w["group_size"]), "--prompt-tokens", str(w["prompt_tokens"]), "--max-tokens", str(w["max_tokens"]),
              "--name", name, *(["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs is not None else [])]
    if args.gpus == 1:
        argv = ["bench.colocated", *common, "--steps", str(args.steps), "--k", ks, "--lr", str(w["lr"]),
                "--timeout", str(args.timeout)]
    else:
        argv = ["bench.pipeline_speedup", *common, "--steps", str(args.steps), "--phases", ks,
                "--transport", "nccl", "--enforce-eager", "0", "--timeout", str(limit), "--compile",
                "--engines-per-gpu", str(args.engines_per_gpu)]
    if args.micro_batch_tokens is not None:
        argv += ["--micro-batch-tokens", str(args.micro_batch_tokens)]
    RUNS.mkdir(parents=True, exist_ok=True)
    child = start_child(name, [sys.executable, "-m", *argv], RUNS / f"{name}.log")
    try:
        child.proc.wait(limit + 120)
    except subprocess.TimeoutExpired:
        pass  # stopped below; its result, if any, is read
    finally:
        child.stop(grace=10)
    path = RESULTS / f"{name}.json"
    command = {"command": "python -m " + " ".join(argv)}
    if not path.exists():
        return {f"k{k}": command | {"error": child.tail(20)} for k in ks.split(",")}
    metrics = json.loads(path.read_text())["metrics"]
    if args.gpus == 1:
        differs = [f"--{k.replace('_', '-')} {v}" for k, v in (("max_num_seqs", args.max_num_seqs),
                                                                  ("micro_batch_tokens", args.micro_batch_tokens))
                   if v is not None]
        return {f"k{ks}": command | metrics | {"differs_from_config": differs}}
    return {f"k{k}": command | metrics.get("phases", {}).get(f"k{k}", {"error": "no phase"}) for k in ks.split(",")}


if __name__ == "__main__":
    sys.exit(main())
