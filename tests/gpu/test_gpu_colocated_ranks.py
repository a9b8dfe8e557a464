"""GPU, two and four devices: one engine on each training GPU, `pipeline run -c configs/colocated-2gpu.yaml` (issue 54,
setup 2) on the 0.5B shape with random weights: two learner ranks on GPUs 0 and 1, generator i on GPU i, one command;
and the same config with four ranks and four generators on GPUs 0-3 (issue 58, item 4: run.learner_gpus, run.generators
and run.generator_gpus set on the command line). The run holds:
- every generator registers and applies every version in order: the one on rank 0's GPU over CUDA IPC (it copies rank
  0's buckets), the others by NCCL broadcast from rank 0 (only rank 0 sends: configs/colocated-2gpu.yaml);
- every version is trained, on rollouts of every generator;
- by process id (nvidia-smi's compute apps), generator i and learner rank i hold memory on GPU i only.
Prints each GPU's peak and the steps/min.

    python -m pytest -m gpu -s tests/gpu/test_gpu_colocated_ranks.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from tests.conftest import Proc
from tests.gpu.helpers import MemorySamples, gpu_count, services
from tests.gpu.test_gpu_pipeline import model_dir  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
    pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs (a learner rank and an engine on each)"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi (memory by process id)"),
]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.mark.parametrize("ranks", [2, 4], ids=["2-ranks", "4-ranks"])
def test_learner_ranks_each_with_an_engine_on_its_own_gpu(model_dir: Path, tmp_path: Path, ranks: int) -> None:  # noqa: F811
    if gpu_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    gpus = ",".join(str(i) for i in range(ranks))
    sets = [f"model.path={model_dir}", f"data.path={model_dir.parent / 'data.jsonl'}", "data.chat_template=false",
            "data.system_prompt=null", "rewards=[{fn: 'tests.gpu.helpers:parity_reward'}]",
            f"trainer.total_steps={STEPS}", "trainer.batch_size=8", "trainer.group_size=4",
            "trainer.micro_batch_tokens=4096", "sampling.max_tokens=32", "sampling.ignore_eos=true",
            "generator.max_model_len=256", "eval.every=0", "trainer.checkpoint_every=0",
            f"run.learner_gpus={gpus}", f"run.generator_gpus=[{gpus}]", f"run.generators={ranks}",
            "generator.lease_size=2",  # the window's 16 groups in leases for every generator, not two
            "generator.enforce_eager=true"]  # start-up is not what is measured: no CUDA graphs
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    argv = [sys.executable, "-m", "pipeline", "run", "-c", str(ROOT / "configs" / "colocated-2gpu.yaml"),
            "--run-dir", str(run_dir), *[x for s in sets for x in ("--set", s)]]
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
    memory, pids = MemorySamples(), {}
    run = Proc(argv, log, env={"PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
    try:
        deadline = time.monotonic() + 480  # seconds: torchrun's ranks, the engines, 6 steps
        while run.proc.poll() is None:
            assert time.monotonic() < deadline, "run did not finish: " + log.read_text(errors="replace")[-3000:]
            pids |= services(log, ranks)
            memory.sample(pids)
            time.sleep(1.0)
    finally:
        run.stop()
    assert run.proc.returncode == 0, log.read_text(errors="replace")[-3000:]

    records, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    ids = {name: next(e["generator"] for e in events if e["event"] == "register" and f"-{pid}-" in e["generator"])
           for name, pid in pids.items() if name.startswith("generator")}
    transports = {name: next(e["transport"] for e in events if e["event"] == "register" and e["generator"] == gid)
                  for name, gid in ids.items()}
    assert transports == {f"generator-{i}": "nccl" if i else "ipc" for i in range(ranks)}, transports
    for name, gid in ids.items():
        applied = [(e["version"], e["via"]) for e in events
                   if e["event"] == "weights_applied" and e["generator"] == gid]
        assert applied == [(v, transports[name]) for v in range(STEPS + 1)], (name, applied)
        assert sum(r["groups_by_generator"].get(gid, 0) for r in records) > 0, f"no rollout of {name} was trained"

    where = {f"{kind}{i}": {i} for i in range(ranks) for kind in ("generator-", "rank")}
    seen = {name: memory.gpus_of(name) for name in where}
    elapsed = records[-1]["time/elapsed_s"] - records[0]["time/elapsed_s"]
    figures = {"gpus_seen": {k: sorted(v) for k, v in seen.items()},
               "gpu_peak_mib": {i: max(memory.used_mib(i), default=0) for i in range(ranks)},
               "steps_per_min": 60 * (len(records) - 1) / elapsed}
    print(json.dumps(figures))
    assert any(seen.values()), (
        f"nvidia-smi listed none of the run's processes (it listed {sorted(memory.listed)[:8]}): in a PID namespace of "
        "its own (a container) the check by process id cannot be made here")
    assert seen == where, seen
