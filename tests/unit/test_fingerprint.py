"""What a model's fingerprint covers (pipeline/fingerprint.py), and what a resume compares it with
(learner/checkpoint.py): files rewritten in place behind the cache, generation_config.json, a sharded checkpoint's
index, and checkpoints that recorded a fingerprint of an earlier format. Model directories of made-up bytes: a
fingerprint reads files, never loads them. The builtin model's own test is in test_runspec.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from pipeline import fingerprint
from pipeline.fingerprint import weights_fingerprint


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))


def _model(root: Path, shards: int = 1, ext: str = "safetensors") -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "transformers_version": "4.0"}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "transformers_version": "4.0"}))
    (root / "tokenizer.json").write_text("{}")
    names = [f"model.{ext}"] if shards == 1 else [f"model-{i:05d}-of-{shards:05d}.{ext}" for i in range(1, shards + 1)]
    for i, name in enumerate(names):
        (root / name).write_bytes(bytes([i]) * 4096)
    if shards > 1:
        index = "model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json"
        weight_map = {f"layers.{i}.weight": name for i, name in enumerate(names)}
        (root / index).write_text(json.dumps({"metadata": {"total_size": 4096 * shards}, "weight_map": weight_map}))
    return root


def _cached(path: Path) -> bool:
    try:
        cache = json.loads((Path(os.environ["PIPELINE_CACHE"]) / "fingerprints.json").read_text())
    except FileNotFoundError:
        return False
    return any(key.startswith(f"{path.resolve()}:") for key in cache)


def test_a_weight_file_rewritten_in_place_with_its_mtime_restored_is_hashed_again(tmp_path):
    """`cp -p` or `rsync -a --inplace` over a model: same path, size, inode and modification time, other bytes. The
    change time moves with any write or utime, and no one can set it back."""
    model = _model(tmp_path / "m")
    weights = model / "model.safetensors"
    while time.time_ns() <= weights.stat().st_ctime_ns + fingerprint.SETTLED_NS:  # written a while ago: cached
        time.sleep(0.05)
    first = weights_fingerprint(model)
    assert _cached(weights)
    before = weights.stat()
    with weights.open("r+b") as f:  # in place, as cp -p and rsync --inplace write
        f.write(b"\xff" * 4096)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert weights_fingerprint(model) != first


def test_a_file_changed_in_the_last_second_is_hashed_but_not_cached(tmp_path):
    """A write within the timestamps' granularity (a clock tick, a second on some filesystems) could leave all of a
    file's key as it was: a digest is cached only once its file has settled, as git's index does."""
    model = _model(tmp_path / "m")
    first = weights_fingerprint(model)
    assert not _cached(model / "model.safetensors")
    (model / "model.safetensors").write_bytes(b"\xff" * 4096)
    assert weights_fingerprint(model) != first


def test_generation_config_is_the_models_but_what_a_save_stamps_in_it_is_not(tmp_path):
    """vLLM adds generation_config.json's EOS ids to the stop tokens: another one samples otherwise."""
    model = _model(tmp_path / "m")
    first = weights_fingerprint(model)
    generation = model / "generation_config.json"
    generation.write_text(json.dumps({"eos_token_id": 2, "transformers_version": "5.0"}, indent=2))
    assert weights_fingerprint(model) == first
    generation.write_text(json.dumps({"eos_token_id": [2, 7], "transformers_version": "4.0"}))
    assert weights_fingerprint(model) != first


@pytest.mark.parametrize("ext", ["safetensors", "bin"])
def test_a_sharded_models_files_are_those_its_index_names(tmp_path, ext):
    """A loader reads the shards the index names; a stray file beside them (an older save's shard) is not read, and
    a good host holding one is not refused. The index's metadata is not the model; its weight_map is."""
    model = _model(tmp_path / "m", shards=2, ext=ext)
    first = weights_fingerprint(model)
    (model / f"model-00003-of-00003.{ext}").write_bytes(b"stray" * 100)
    assert weights_fingerprint(model) == first
    index = next(model.glob("*.index.json"))
    data = json.loads(index.read_text())
    index.write_text(json.dumps({**data, "metadata": {"total_size": 1}}))
    assert weights_fingerprint(model) == first
    (model / f"model-00002-of-00002.{ext}").write_bytes(b"\xff" * 4096)
    assert weights_fingerprint(model) != first
    index.write_text(json.dumps({**data, "weight_map": {**data["weight_map"], "head.weight": f"missing.{ext}"}}))
    with pytest.raises(FileNotFoundError, match=f"missing.{ext}"):
        weights_fingerprint(model)


def test_a_resume_checks_a_checkpoints_fingerprint_the_way_it_was_recorded(tmp_path):
    """A checkpoint of an earlier release recorded a format-1 fingerprint (no generation_config.json, no index): its
    resume on the same files goes on, on other files is refused; one of a format this release does not know is
    refused saying so, not taken for other files."""
    from learner import checkpoint
    from pipeline.config import config_from_dict

    model = _model(tmp_path / "m", shards=2)
    cfg = config_from_dict({"model": {"path": str(model)}})
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "v2").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("v2")

    def recorded(**fields) -> None:
        what = {"kind": "full", "model.dtype": cfg.model.dtype, "model.quantization": None, **fields}
        (run_dir / "checkpoints" / "v2" / "weights.json").write_text(json.dumps(what))

    assert weights_fingerprint(model, 1) == "1c8fc19bd51ea73de282a32d7a8ac4ed"  # what the earlier release computed
    assert weights_fingerprint(model) != weights_fingerprint(model, 1)
    recorded(**{"model.path": weights_fingerprint(model, 1)})
    assert checkpoint.check_resume(cfg, run_dir) == []
    recorded(**{"model.path": weights_fingerprint(model), "fingerprint_format": fingerprint.FORMAT})
    assert checkpoint.check_resume(cfg, run_dir) == []
    recorded(**{"model.path": weights_fingerprint(model)})  # a format-2 string recorded as format 1: other files
    with pytest.raises(checkpoint.CheckpointError, match="its files' fingerprint"):
        checkpoint.check_resume(cfg, run_dir)
    recorded(**{"model.path": weights_fingerprint(model), "fingerprint_format": 99})
    with pytest.raises(checkpoint.CheckpointError, match="format 99, which this release cannot compute"):
        checkpoint.check_resume(cfg, run_dir)
