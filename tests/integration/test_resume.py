"""`--resume` continues the run it resumes (real learner and generator, then the command line): a LoRA run started
with --set values is resumed with another alpha, use_rslora, target modules or base, or with a config file that lacks
its first start's --set, and each is refused at start, naming the field, the run's files untouched; the model files
changed under the same path are refused by their fingerprint; `pipeline learner --resume RUN_DIR` alone continues with
the first start's --set values (RUN_DIR/config.yaml)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.metrics import read_jsonl
from tests.conftest import REPO, wait_for
from tests.integration.helpers import start_learner

pytestmark = pytest.mark.integration


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resume_that_would_train_another_run_is_refused_naming_the_field(procs, tmp_path, model_cache, free_port):
    from pipeline.tinymodel import build_tiny_model, resolve_model_path

    base = tmp_path / "base"  # the run's model, at a path of its own: its files change below
    shutil.copytree(resolve_model_path("builtin:tiny"), base)
    other = build_tiny_model(tmp_path / "other", seed=1)
    run_dir = tmp_path / "run"
    first = ["model.lora={r: 8, alpha: 16}", f"model.path={base}", "trainer.total_steps=2", "trainer.batch_size=4",
             "trainer.group_size=4", "trainer.max_staleness=0", "run.tensorboard=false"]
    learner = start_learner(procs, run_dir, free_port, first)
    gen = procs(["generator", "--learner", f"tcp://127.0.0.1:{free_port}"], tmp_path / "gen.log")
    assert learner.wait(600) == 0, learner.tail()
    assert gen.wait(60) == 0, gen.tail()
    assert (run_dir / "checkpoints" / "latest").read_text() == "v2"
    before = _files(run_dir)

    refusals = {
        "model.lora.alpha": ["--set", "model.lora.alpha=64"],
        "model.lora.use_rslora": ["--set", "model.lora.use_rslora=true"],
        "model.lora.target_modules": ["--set", "model.lora.target_modules=[q_proj, v_proj]"],
        "model.path": ["--set", f"model.path={other}"],
        "model.lora": ["-c", "configs/demo.yaml"],  # the README's restart command, without the first start's --set
    }
    for field, args in refusals.items():
        out = _cli("learner", "--resume", str(run_dir), *args)
        assert out.returncode == 2 and field in out.stderr and "config.yaml" in out.stderr, (field, out.stderr)
    # the same path, other files: refused by the checkpoint's fingerprint of the base
    shutil.copy(other / "model.safetensors", base / "model.safetensors")
    out = _cli("learner", "--resume", str(run_dir))
    assert out.returncode == 2 and "fingerprint" in out.stderr and "model.path" in out.stderr, out.stderr
    assert _files(run_dir) == before  # nothing was written

    # the run's own config: the first start's --set values hold (what every generator is given to serve)
    shutil.copy(resolve_model_path("builtin:tiny") + "/model.safetensors", base / "model.safetensors")
    resumed = procs(["learner", "--resume", str(run_dir), "--set", "trainer.total_steps=3"], tmp_path / "resumed.log")
    wait_for(lambda: "resumed at version 2" in resumed.log_path.read_text(), 300, "the resumed learner", [resumed])
    address = f"tcp://127.0.0.1:{free_port}"  # hub.port of the first start, from config.yaml
    spec = wait_for(lambda: _spec(address), 60, "the resumed hub's spec", [resumed])
    assert spec.config["model"]["lora"]["alpha"] == 16 and spec.config["model"]["path"] == str(base)
    assert spec.config["trainer.group_size"] == 4 and spec.config["trainer.total_steps"] == 3
    procs(["generator", "--learner", address], tmp_path / "gen2.log")
    assert resumed.wait(600) == 0, resumed.tail()
    assert [r["version"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def _spec(address: str) -> P.RunSpec | None:
    try:
        reply = request_once(address, P.SpecRequest("test-operator"))
    except P.PeerLost:
        return None
    return reply if isinstance(reply, P.RunSpec) else None
