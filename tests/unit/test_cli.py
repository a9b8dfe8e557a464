"""The command line's own errors (no engines are started)."""

import subprocess
import sys


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=120)


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
