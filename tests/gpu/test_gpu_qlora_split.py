"""GPU, two devices: QLoRA beside a vLLM GPU, `pipeline run -c configs/qlora-2gpu.yaml` (issue 54, setup 1), on the
Qwen2.5-7B shape with random weights (bench/common.py build_model): the learner with its NF4 base and LoRA r 16 on
GPU 0, the generator on GPU 1, each held to 40 GB as on two 40 GB A100s, whatever the cards here. The run holds:
- by process id (nvidia-smi's compute apps), the learner's processes hold no memory on GPU 1, the generator's none
  on GPU 0;
- GPU 1's memory stays flat (within FLAT_MIB) from the engine's first trained version to the last, sampled every
  second (TRL's trainer wrapped the model in DataParallel over both GPUs and the vLLM GPU grew until it ran out);
- neither service's processes together pass 40 GB;
- every version is trained, broadcast over NCCL and applied, in order.
The learner is capped by trainer.gpu_memory_gb (the config's 39), the generator by a gpu_memory_utilization that gives
vLLM the 23.4 GB the config gives it on an A100 (merged mode's base copy, 13.1 GB, lies beside it). Prints the figures.

    python -m pytest -m gpu -s tests/gpu/test_gpu_qlora_split.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.conftest import Proc
from tests.gpu.helpers import MemorySamples, gpu_count, services, smi, write_dataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
    pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs (learner on 0, generator on 1)"),
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (QLoRA)"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi (memory by process id)"),
]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
CAP = 40 * 10**9  # bytes a service may hold on its GPU: an A100 of 40 GB has 42.5 (GB of 10^9 bytes, as memory.py's)
VLLM_BYTES = 23.4e9  # the config's gpu_memory_utilization 0.55 of an A100's 42.5 GB
FLAT_MIB = 512  # GPU 1's memory may move this much once the engine has applied a trained version


@pytest.fixture(scope="module")
def qwen_7b() -> Path:
    """The 7B shape with random weights, built once per machine into the benchmarks' cache, in a process of its own
    (this one holds no GPU memory while the run is sampled)."""
    from bench.common import MODELS

    dest = MODELS / "q-7b"  # bench/common.py model_from_args's, so benchmarks and tests share it
    code = f"from pathlib import Path; from bench.common import build_model; build_model('7b', Path({str(dest)!r}))"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=900)
    return dest


def test_qlora_learner_on_gpu_0_and_its_generator_on_gpu_1_each_under_40_gb(qwen_7b: Path, tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data.jsonl", rows=512, prompt_tokens=16)
    total = {int(i): int(mib) * 2**20 for i, mib in smi("index,memory.total")}
    sets = [f"model.path={qwen_7b}", f"data.path={data}", "rewards=[{fn: 'tests.gpu.helpers:parity_reward'}]",
            f"trainer.total_steps={STEPS}", "trainer.batch_size=8", "trainer.group_size=4", "sampling.max_tokens=64",
            "sampling.ignore_eos=true", "eval.every=0", "trainer.checkpoint_every=0",
            f"generator.gpu_memory_utilization={VLLM_BYTES / total[1]:.4f}",
            "generator.enforce_eager=true"]  # start-up is not what is measured: no CUDA graphs
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    argv = [sys.executable, "-m", "pipeline", "run", "-c", str(ROOT / "configs" / "qlora-2gpu.yaml"),
            "--run-dir", str(run_dir), *[x for s in sets for x in ("--set", s)]]
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
    memory = MemorySamples()
    run = Proc(argv, log, env={"PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
    try:
        deadline = time.monotonic() + 900  # seconds: the 7B loads and is quantized, the engine starts, 8 steps
        while run.proc.poll() is None:
            assert time.monotonic() < deadline, "run did not finish: " + log.read_text(errors="replace")[-3000:]
            memory.sample(services(log, 1))
            time.sleep(1.0)
    finally:
        run.stop()
    assert run.proc.returncode == 0, log.read_text(errors="replace")[-3000:]

    records, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))  # versions advance
    assert [e["transport"] for e in events if e["event"] == "register"] == ["nccl"]  # GPU 0 to GPU 1
    applied = [e for e in events if e["event"] == "weights_applied"]
    assert [e["version"] for e in applied] == list(range(STEPS + 1)), applied
    learner_log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "on each rank's GPU of 39.0 GB (trainer.gpu_memory_gb; activations besides)" in learner_log  # the cap

    seen = {name: memory.gpus_of(name) for name in ("learner", "generator-0")}
    elapsed = records[-1]["time/elapsed_s"] - records[0]["time/elapsed_s"]
    figures = {"gpus_seen": {k: sorted(v) for k, v in seen.items()},
               "peak_mib": {name: memory.peak_mib(name) for name in seen},
               "gpu_peak_mib": {i: max(memory.used_mib(i), default=0) for i in (0, 1)},
               "learner_peak_allocated_gib": max(r.get("learner/peak_gpu_gib", 0) for r in records),
               "steps_per_min": 60 * (len(records) - 1) / elapsed,
               "gpu1_mib": memory.used_mib(1)}
    print(json.dumps(figures))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "qlora_split.json").write_text(json.dumps(figures))
    assert seen["learner"] and seen["generator-0"], (
        f"nvidia-smi listed none of the run's processes (it listed {sorted(memory.listed)[:8]}): in a PID namespace of "
        "its own (a container) the check by process id cannot be made here")
    assert seen == {"learner": {0}, "generator-0": {1}}, seen  # GPU 1 holds nothing of the learner's, and back
    for name in seen:
        assert memory.peak_mib(name) * 2**20 <= CAP, figures["peak_mib"]
    first, last = applied[1]["time"], applied[-1]["time"]  # the engine's first trained version, and its last
    flat = memory.used_mib(1, first, last)
    assert len(flat) >= 5 and max(flat) - min(flat) <= FLAT_MIB, flat
