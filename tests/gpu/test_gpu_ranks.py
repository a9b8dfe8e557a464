"""GPU, two learner ranks: `pipeline learner --gpus 0,1` runs torchrun's agent in its own process, one nccl rank per
GPU (each takes its LOCAL_RANK's), with a generator on GPU 1. Rank 1 is killed (SIGKILL) mid-run: the run ends, rank
0 within end_if_stuck's grace though its nccl all-reduce waits for rank 1, with no /dev/shm folder of the run left;
the same command with --resume finishes the run with every prompt trained once. And the two ranks compute the
proximal log-probs of the groups buffered first while they wait (trainer.early_proximal), rank 0's news of them sent
to rank 1 over nccl (tests/integration/test_early_proximal.py runs the same on gloo ranks).

    python -m pytest -m gpu tests/gpu/test_gpu_ranks.py
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest

from pipeline.metrics import read_jsonl
from pipeline.netutil import reserved_port
from tests.conftest import running, wait_for
from tests.gpu.helpers import gpu_count, rank_pid
from tests.integration.test_early_proximal import LEARNER, SLOW, computed_ahead

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
]
STEPS = 30


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs (learner ranks on 0 and 1)")
def test_two_nccl_ranks_lose_one_end_and_resume_with_every_prompt_once(procs, tmp_path):
    run_dir, port = tmp_path / "run", reserved_port()
    common = ["-c", "configs/demo.yaml", "--gpus", "0,1", "--set", f"hub.port={port}", "--set",
              f"trainer.total_steps={STEPS}", "--set", "trainer.checkpoint_every=5", "--set",
              "trainer.rank_timeout_s=120"]
    learner = procs(["learner", *common, "--run-dir", str(run_dir)], tmp_path / "learner.log")
    wait_for(lambda: (run_dir / "hub.json").exists(), 300, "the hub", [learner])
    gen = procs(["generator", "-c", "configs/demo.yaml", "--learner", f"tcp://127.0.0.1:{port}", "--gpus", "1",
                 "--set", "generator.gpu_memory_utilization=0.3"], tmp_path / "generator.log")
    wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 6, 600, "6 steps", [learner, gen])
    rank0, rank1 = rank_pid(learner.pid, 0), rank_pid(learner.pid, 1)
    run_id = (run_dir / "hub.json").read_text().split('"run_id": "')[1].split('"')[0]
    os.kill(rank1, signal.SIGKILL)
    start = time.monotonic()
    assert learner.wait(60) != 0, learner.tail()
    assert time.monotonic() - start < 30  # rank 0 ended by its grace (10 s), not torchrun's SIGKILL (30 s)
    assert not running(rank0)
    assert not Path(f"/dev/shm/pipeline-{run_id}").exists()  # its files removed
    log = (tmp_path / "learner.log").read_text()
    assert "learner rank 1 failed with exit code -9" in log, log[-3000:]

    resumed = procs(["learner", *common, "--resume", str(run_dir)], tmp_path / "resumed.log")
    assert resumed.wait(900) == 0, resumed.tail()
    assert gen.wait(120) == 0, gen.tail()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    trained = [(t[0], t[1]) for r in records for t in r["trained"]]
    assert len(trained) == len(set(trained))  # every prompt of each epoch once


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs (learner ranks on 0 and 1)")
def test_two_nccl_ranks_compute_the_proximal_log_probs_ahead_together(procs, tmp_path):
    """m2po at k = 0 with slow rewards, so every step waits for groups that come a few at a time: a rank left without
    rank 0's news, or choosing another micro-batch, would wait in a collective the other never joins."""
    run_dir, port = tmp_path / "run", reserved_port()
    sets = [f"hub.port={port}", SLOW, *LEARNER]
    learner = procs(["learner", "-c", "configs/demo.yaml", "--gpus", "0,1", "--run-dir", str(run_dir),
                     *[x for s in sets for x in ("--set", s)]], tmp_path / "learner.log")
    wait_for(lambda: (run_dir / "hub.json").exists(), 300, "the hub", [learner])
    gen = procs(["generator", "-c", "configs/demo.yaml", "--learner", f"tcp://127.0.0.1:{port}", "--gpus", "1",
                 "--set", "generator.gpu_memory_utilization=0.3", "--set", SLOW], tmp_path / "generator.log")
    assert learner.wait(600) == 0, learner.tail()
    assert gen.wait(120) == 0, gen.tail()
    computed_ahead(run_dir)
