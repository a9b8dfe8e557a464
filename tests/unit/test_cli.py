"""The command line's own errors (no engines are started)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_bad_config_field_fails_at_load_with_its_dotted_name(tmp_path):
    out = _cli("run", "--set", "trainer.max_stalness=1")
    assert out.returncode == 2
    assert "trainer.max_stalness: unknown field (did you mean max_staleness?)" in out.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("generator:\n  update_mode: sometimes\n")
    out = _cli("learner", "-c", str(cfg))
    assert out.returncode == 2 and "generator.update_mode: 'sometimes' is not one of" in out.stderr


def test_status_and_set_without_a_learner_fail_clearly(free_port):
    out = _cli("status", "--learner", f"tcp://127.0.0.1:{free_port}")
    assert out.returncode == 1 and "no reply from the learner" in out.stderr
    out = _cli("set", "--learner", f"tcp://127.0.0.1:{free_port}", "trainer.max_staleness")
    assert out.returncode == 2 and "expected KEY=VALUE" in out.stderr


def _a_run(run_dir: Path) -> None:
    """What a learner leaves in its run directory when it is killed after 3 steps, with a checkpoint at v2."""
    (run_dir / "checkpoints" / "v2").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("v2")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    (run_dir / "config.yaml").write_text("run:\n  name: again\n")
    (run_dir / "events.jsonl").write_text(json.dumps({"event": "register", "generator": "gen-1"}) + "\n")
    (run_dir / "hub.json").write_text(json.dumps({"address": "tcp://127.0.0.1:1", "pid": 1, "run_id": "again-x"}))


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_directory_that_holds_a_run_is_refused_with_the_ways_on_and_left_as_it_was(tmp_path):
    run_dir = tmp_path / "again"
    _a_run(run_dir)
    before = _files(tmp_path)
    run = _cli("run", "--set", f"run.dir={tmp_path}", "--set", "run.name=again")
    learner = _cli("learner", "-c", str(REPO / "configs" / "demo.yaml"), "--run-dir", str(run_dir))
    for out in (run, learner):
        assert out.returncode == 2, out.stderr
        assert f"{run_dir} holds a run already (3 steps done, newest checkpoint v2, not finished)" in out.stderr
        assert f"pipeline run --resume {run_dir}" in out.stderr and "--set run.name=NEW_NAME" in out.stderr
    assert run.stderr.startswith("pipeline run: ") and learner.stderr.startswith("pipeline learner: ")
    assert _files(tmp_path) == before  # not a byte written, no launch.yaml, no log
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _cli("run", "--resume", str(empty))
    assert out.returncode == 2 and f"--resume {empty}: no checkpoint to resume from" in out.stderr
    assert not list(empty.iterdir())


def test_set_with_a_misspelt_key_says_what_was_meant_as_a_config_file_does(tmp_path, capsys):
    from pipeline.config import ConfigError, load_config
    from pipeline.entrypoints.cli import main
    from tests.unit.peers import new_hub

    misspelt = {"trainer.max_stalness": "trainer.max_stalness: unknown field (did you mean max_staleness?)",
                "trainr.lr": "trainr: unknown field (did you mean trainer?)"}
    hub = new_hub(tmp_path)
    try:
        for key, message in misspelt.items():
            assert main(["set", "--learner", hub.address, f"{key}=2"]) == 2
            assert f"pipeline set: {message}" in capsys.readouterr().err
            with pytest.raises(ConfigError) as in_a_file:
                load_config(None, [f"{key}=2"])
            assert str(in_a_file.value) == message
    finally:
        hub.stop()
