"""GPU, one device for everything: `pipeline learner --gpus 0` and `pipeline generator --gpus 0` as separate
processes. `auto` picks the ipc transport (weights/ipc.py): every version, the one current at registration
too, is copied out of the learner's shared buckets in order, the replayed copies are checked equal to vLLM's
load_weights, and nothing is left in /dev/shm once the run ends."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from pipeline.metrics import read_jsonl
from tests.gpu.helpers import gpu_count
from tests.gpu.test_gpu_pipeline import STEPS, _config, _run_to_end, _tail, model_dir  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
    pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU"),
]


def _shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def test_a_generator_on_the_learners_gpu_copies_every_version_over_cuda_ipc(model_dir: Path,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    before = _shm()
    cfg = _config(model_dir, tmp_path)
    settings = yaml.safe_load(cfg.read_text())
    settings["generator"]["gpu_memory_utilization"] = 0.35  # beside the learner
    cfg.write_text(yaml.safe_dump(settings))
    watch = _run_to_end(cfg, run_dir, tmp_path, "0", "0", timeout=300)
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["transport"] for e in events if e["event"] == "register"] == ["ipc"]  # picked by `auto`
    applied = [(e["version"], e["via"]) for e in events if e["event"] == "weights_applied"]
    assert [v for v, _ in applied] == list(range(0, STEPS + 1)), applied  # each one, in order, v0 too
    assert {via for _, via in applied} == {"ipc"}
    log = (tmp_path / "generator.log").read_text()
    assert "weights copy plan verified" in log, _tail(tmp_path / "generator.log")
    rejected = {k: v for k, v in records[-1].items() if k.startswith("hub/rejected") and v}
    assert not rejected, rejected
    assert _shm() - before == set(), "left in /dev/shm"
    watch.check({"learner": [0], "generator": [0]})
