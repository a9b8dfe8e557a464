"""GPU, four devices: the Qwen2.5-7B shape held to four 24 GB cards (issue 58, setup 1), with random weights
(bench/common.py build_model), each run started as a user starts it, `pipeline run -c CONFIG`:
- full weights, configs/7b-4x24gb.yaml: a ZeRO-3 learner on GPUs 0-2, Adam's state and the fp32 masters offloaded to
  the CPU, each rank's allocator capped by the config's trainer.gpu_memory_gb; one generator on GPU 3;
- LoRA, configs/7b-lora-4x24gb.yaml: the learner (its base in bf16, LoRA r 16) on GPU 0, a generator on each of GPUs
  1-3 serving every version as a vLLM LoRA adapter.
Each generator's vLLM gets what the config gives it of a 24 GB card (gpu_memory_utilization 0.9 of 24 GB, set here as
a fraction of this card). From nvidia-smi, sampled every second while the run goes on, the runs hold:
- each GPU's memory used, and each learner rank's and each generator's processes together, stay within 24 GB (of 10^9
  bytes: a "24 GB" card's 24 GiB are 25.8);
- by process id, learner rank i holds memory on GPU i only, and each generator on its own GPU only;
- every version is trained, and applied by every generator in order, over NCCL;
- the policy moves: every step's gradient is finite and non-zero, and on the trained samples the KL between the
  version that sampled them and the learner one version later (mismatch/kl_lag1) passes the engine's own mismatch at
  equal versions (mismatch/kl_lag0). With random weights and a parity reward the reward does not learn in a few
  steps; this KL says the weights changed and the engines sampled from the changed weights.
The full-weights run is stopped once STEPS versions are applied: its final checkpoint would write 7B's weights and
91 GB of optimizer state. The engines run eager (CUDA graphs and vLLM's torch.compile take minutes on a fresh
machine): the shipped configs' CUDA graphs are not measured here. Prints the figures (also to $OUT/7b_24gb_*.json).

    python -m pytest -m gpu -s tests/gpu/test_gpu_7b_24gb.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.conftest import Proc
from tests.gpu.helpers import MemorySamples, gpu_count, services, smi, write_dataset
from tests.gpu.test_gpu_qlora_split import qwen_7b  # noqa: F401  (the 7B shape, built once per machine)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
    pytest.mark.skipif(gpu_count() < 4, reason="needs 4 GPUs (a learner and generators on four cards)"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi (memory by process id)"),
]
ROOT = Path(__file__).resolve().parents[2]
CARD = 24 * 10**9  # bytes: the card each GPU is held to
CAP_MIB = CARD // 2**20
VLLM_SHARE = 0.9  # the configs' gpu_memory_utilization, of a 24 GB card


def _sets(model: Path, tmp_path: Path, steps: int, lr: float, gpus: list[int]) -> list[str]:
    """What the test changes in a shipped config: the model, data and reward, a short run, vLLM's share of the card."""
    data = write_dataset(tmp_path / "data.jsonl", rows=512, prompt_tokens=16)
    total = {int(i): int(mib) * 2**20 for i, mib in smi("index,memory.total")}
    share = VLLM_SHARE * CARD / min(total[g] for g in gpus)
    return [f"model.path={model}", f"data.path={data}", "rewards=[{fn: 'tests.gpu.helpers:parity_reward'}]",
            f"trainer.total_steps={steps}", "trainer.batch_size=8", "trainer.group_size=4", f"trainer.lr={lr}",
            "sampling.max_tokens=32", "sampling.ignore_eos=true", "eval.every=0", "trainer.checkpoint_every=0",
            f"generator.gpu_memory_utilization={share:.4f}",
            "generator.enforce_eager=true"]  # start-up is not what is measured: no CUDA graphs


def _run(config: str, sets: list[str], tmp_path: Path, ranks: int, timeout: float, stop_at: int = 0):
    """`pipeline run -c configs/CONFIG` until it ends, or with `stop_at` until every generator applied that version
    (then stopped as by Ctrl-C), sampling nvidia-smi every second: (the samples, the services' process ids, the run
    directory)."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    argv = [sys.executable, "-m", "pipeline", "run", "-c", str(ROOT / "configs" / config), "--run-dir", str(run_dir),
            *[x for s in sets for x in ("--set", s)]]
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
    memory, pids = MemorySamples(), {}
    memory.sample({})  # the cards before the run
    run = Proc(argv, log, env={"PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
    try:
        deadline = time.monotonic() + timeout
        while run.proc.poll() is None:
            assert time.monotonic() < deadline, "run did not finish: " + log.read_text(errors="replace")[-3000:]
            pids |= services(log, ranks)
            memory.sample(pids)
            gens = [n for n in pids if n.startswith("generator")]
            if stop_at and gens and all(stop_at in [v for v, _ in _applied(run_dir, pids[n])] for n in gens):
                break
            time.sleep(1.0)
        ended = run.proc.poll()  # None: stopped by the test
    finally:
        run.stop(grace=60)  # seconds: 7B ranks and engines let go of their memory before the next test
    assert ended is None if stop_at else ended == 0, log.read_text(errors="replace")[-3000:]
    return memory, pids, run_dir


def _applied(run_dir: Path, pid: int) -> list[tuple[int, str]]:
    """(version, via) of each version the generator of process `pid` applied, in order."""
    events = read_jsonl(run_dir / "events.jsonl")
    gid = next((e["generator"] for e in events if e["event"] == "register" and f"-{pid}-" in e["generator"]), None)
    return [(e["version"], e["via"]) for e in events if e["event"] == "weights_applied" and e["generator"] == gid]


def _check(memory: MemorySamples, pids: dict[str, int], run_dir: Path, steps: int, where: dict[str, set[int]],
           name: str) -> None:
    """The checks both runs share; `where`: the GPUs each service may hold memory on."""
    records, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    logs = [p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log"))]
    seen = {n: memory.gpus_of(n) for n in where}
    kl = {lag: [r[f"mismatch/kl_lag{lag}"] for r in records if f"mismatch/kl_lag{lag}" in r] for lag in (0, 1)}
    keep = ("version", "loss", "grad_norm", "mismatch/kl_lag0", "mismatch/kl_lag1", "entropy/mean", "staleness/max_lag",
            "time/step_s", "time/wait_s", "sync/weights_ms", "learner/peak_gpu_gib")
    figures = {"gpus_seen": {n: sorted(g) for n, g in seen.items()},
               "peak_mib": {n: memory.peak_mib(n) for n in where if len(where[n]) == 1},
               "gpu_peak_mib": {i: max(memory.used_mib(i), default=0) for i in range(4)},
               "idle_mib": memory.samples[0][1], "cap_mib": CAP_MIB,
               "plan": [line for text in logs for line in text.splitlines() if "memory: " in line],  # each side's
               "steps": [{k: r[k] for k in keep if k in r} for r in records]}
    print(json.dumps(figures))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / f"7b_24gb_{name}.json").write_text(json.dumps(figures))

    assert [r["version"] for r in records][:steps] == list(range(1, steps + 1))  # versions advance
    registers = [e for e in events if e["event"] == "register"]
    assert len(registers) == len([n for n in where if n.startswith("generator")]), registers
    assert {e["transport"] for e in registers} == {"nccl"}, registers  # each generator's GPU is no learner's
    for n in where:
        if n.startswith("generator"):  # every version, in order, version 0 too (the run's weights, not the disk's)
            assert [v for v, _ in _applied(run_dir, pids[n])][:steps + 1] == list(range(steps + 1)), n
    assert any("(trainer.gpu_memory_gb; activations besides)" in text for text in logs), figures["plan"]  # the cap

    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records), figures["steps"]
    assert kl[0] and kl[1], f"no step trained samples of lag 0 and of lag 1: {kl}"
    assert sum(kl[1]) / len(kl[1]) > sum(kl[0]) / len(kl[0]), kl  # the weights moved, and the engines with them

    assert any(seen.values()), (
        f"nvidia-smi listed none of the run's processes (it listed {sorted(memory.listed)[:8]}): in a PID namespace of "
        "its own (a container) the check by process id cannot be made here")
    assert seen == where, seen  # no process on a GPU it was not given
    assert all(mib <= CAP_MIB for mib in figures["peak_mib"].values()), figures["peak_mib"]
    assert all(mib <= CAP_MIB for mib in figures["gpu_peak_mib"].values()), figures["gpu_peak_mib"]


STEPS_FULL = 4  # a 7B step with the optimizer on the CPU takes seconds; the run stops after these


def test_7b_full_weights_zero3_offloaded_on_gpus_0_2_and_a_generator_on_gpu_3_each_within_24_gb(
        qwen_7b: Path, tmp_path: Path) -> None:  # noqa: F811
    # lr: 1e-5 moves random weights enough that one version's KL to the next passes the engine's mismatch
    sets = _sets(qwen_7b, tmp_path, 1000, 1e-5, [3])
    # seconds: three ranks load the model in fp32, DeepSpeed builds its CPU Adam and pins the optimizer state; 4 steps
    memory, pids, run_dir = _run("7b-4x24gb.yaml", sets, tmp_path, 3, 540, stop_at=STEPS_FULL)
    where = {"rank0": {0}, "rank1": {1}, "rank2": {2}, "generator-0": {3}, "learner": {0, 1, 2}}
    _check(memory, pids, run_dir, STEPS_FULL, where, "full")


STEPS_LORA = 6


def test_7b_lora_learner_on_gpu_0_and_generators_on_gpus_1_3_each_within_24_gb(
        qwen_7b: Path, tmp_path: Path) -> None:  # noqa: F811
    # lr: adapters start at B = 0 and want a larger rate than full weights to move the policy as much
    sets = _sets(qwen_7b, tmp_path, STEPS_LORA, 1e-3, [1, 2, 3])
    # seconds: the base loads in fp32 while three engines start, 6 steps (setups-4gpu-lora leaves the rest of its call
    # to the four-rank test)
    memory, pids, run_dir = _run("7b-lora-4x24gb.yaml", sets, tmp_path, 1, 360)
    where = {"learner": {0}, "generator-0": {1}, "generator-1": {2}, "generator-2": {3}}
    _check(memory, pids, run_dir, STEPS_LORA, where, "lora")
