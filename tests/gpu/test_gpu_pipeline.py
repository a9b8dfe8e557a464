"""GPU end to end: `pipeline learner --gpus 0` and `pipeline generator --gpus 1` as separate processes.

A random-weight model of Qwen2.5-0.5B's shape is built locally (no download), with a word-level
tokenizer covering its 151936 ids. The test runs a few steps and checks that versions advanced, that
the generator acknowledged every published version (RUN_DIR/events.jsonl `weights_applied`), and
that no process of the generator's group ever held memory on GPU 0 (nvidia-smi's compute apps,
sampled while the run goes on). Processes are stopped by process group, never by name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
    pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (learner on 0, generator on 1)"),
]


def _group_pids(pgid: int) -> set[int]:
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    pids.add(int(d.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _compute_apps() -> dict[int, set[str]]:
    """pid -> uuids of the GPUs it holds memory on."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout
    apps: dict[int, set[str]] = {}
    for line in out.strip().splitlines():
        pid, uuid = (x.strip() for x in line.split(","))
        apps.setdefault(int(pid), set()).add(uuid)
    return apps


def _uuid(index: int) -> str:
    out = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout
    return out.strip()


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    return subprocess.Popen(argv, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group (vLLM's engine core)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT))
    from bench.common import build_model, write_dataset

    root = tmp_path_factory.mktemp("qwen05")
    write_dataset(root / "data.jsonl", rows=256, prompt_tokens=16)
    return build_model("0.5b", root / "model")


def test_learner_and_generator_on_separate_gpus(model_dir: Path, tmp_path: Path) -> None:
    import yaml

    cfg = {
        "model": {"path": str(model_dir), "dtype": "bfloat16"},
        "data": {"path": str(model_dir.parent / "data.jsonl")},
        "rewards": [{"fn": "bench.common:parity_reward"}],
        "sampling": {"max_tokens": 32, "ignore_eos": True},
        "trainer": {"total_steps": STEPS, "batch_size": 4, "group_size": 4, "max_staleness": 1, "lr": 1e-6},
        "generator": {"gpu_memory_utilization": 0.5, "enforce_eager": True, "max_model_len": 256},
        "hub": {"heartbeat_timeout_s": 60.0},
    }
    cfg_path = tmp_path / "gpu.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "pipeline.cli"]
    learner = _start(cli + ["learner", "-c", str(cfg_path), "--run-dir", str(run_dir), "--gpus", "0"],
                     tmp_path / "learner.log")
    generator = None
    gpu0, gpu1 = _uuid(0), _uuid(1)
    seen: dict[int, set[str]] = {}
    try:
        deadline = time.monotonic() + 300  # seconds: DeepSpeed start, vLLM start, a few steps
        while not (run_dir / "hub.json").exists():
            assert learner.poll() is None, (tmp_path / "learner.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no hub.json"
            time.sleep(0.2)
        address = json.loads((run_dir / "hub.json").read_text())["address"]
        generator = _start(cli + ["generator", "-c", str(cfg_path), "--learner", address, "--gpus", "1"],
                           tmp_path / "generator.log")
        while learner.poll() is None:
            assert time.monotonic() < deadline, "run did not finish: " + (tmp_path / "learner.log").read_text()[-3000:]
            assert generator.poll() in (None, 0), (tmp_path / "generator.log").read_text()[-4000:]
            pids = _group_pids(generator.pid)
            for pid, uuids in _compute_apps().items():
                if pid in pids:
                    seen.setdefault(pid, set()).update(uuids)
            time.sleep(0.5)
        assert learner.returncode == 0, (tmp_path / "learner.log").read_text()[-4000:]
    finally:
        if generator is not None:
            _stop(generator)
        _stop(learner)

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    gens = {e["generator"] for e in events if e["event"] == "register"}
    acked = {(e["generator"], e["version"]) for e in events if e["event"] == "weights_applied"}
    assert gens, "no generator registered"
    for g in gens:  # a generator may skip a version when a newer one is already announced, never fall behind
        versions = sorted(v for gg, v in acked if gg == g)
        assert versions and versions[-1] >= STEPS - 1, f"{g} acknowledged {versions}"
    assert not any(gpu0 in uuids for uuids in seen.values()), f"generator processes on GPU 0: {seen}"
    if _compute_apps() or seen:  # nvidia-smi lists processes here (not always inside containers)
        assert any(gpu1 in uuids for uuids in seen.values()), f"generator never seen on GPU 1: {seen}"
