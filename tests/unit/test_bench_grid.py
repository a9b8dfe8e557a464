"""bench/learning_curves.py's grid: a run `pipeline` refuses at start (exit 2) is a mistake every run of the grid
shares, so the grid stops there; it does not start each run again and again (a GPU call once spent 480 s so). And
--set changes every run's config over --config's."""

import argparse

import yaml

from bench.learning_curves import run_config, run_grid
from tests.conftest import REPO


def test_a_grid_whose_config_is_refused_stops_at_the_first_refusal(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "builtin:tiny"}, "data": {"path": "builtin:arithmetic"},
                                      "trainer": {}}))
    args = argparse.Namespace(config=str(config), steps=2, minibatches=1, batch_size=2, group_size=2,
                              enforce_eager=None, generators=1, gpus=False, gpus_per_run=1, gpu_memory=0.1,
                              parallel=2, stagger=0, timeout=120, runs_dir=str(tmp_path / "runs"), threshold=0.5,
                              set=[])
    todo = [(k, "m2po", seed) for k in (0, 8) for seed in (0, 1, 2)]
    reports = []
    runs = run_grid(todo, args, lambda runs, final: reports.append(final))
    out = capsys.readouterr().out
    assert runs == {} and reports == []
    assert "refused at start (exit 2), so is every run of this grid; stopped" in out
    assert "builtin:arithmetic' is not a builtin dataset" in out
    assert "started again" not in out
    root = tmp_path / "runs"
    started = sorted(p.parent.relative_to(root).as_posix() for p in root.rglob("bench.yaml"))
    assert started == ["k0/m2po/s0", "k0/m2po/s1"]  # the first `parallel` runs, none after, none twice


def test_set_changes_every_runs_config_over_the_shipped_files():
    args = argparse.Namespace(config=str(REPO / "configs/gpu-smollm2-reasoning-gym.yaml"), steps=150, minibatches=1,
                              batch_size=32, enforce_eager=0, generators=1, gpus=True, gpus_per_run=1, gpu_memory=0.06,
                              kv_cache_gb=5.0, set=["data.name=basic_arithmetic", "trainer.lr=5.0e-6",
                                                    "eval.extra.deep=[1, 2]"])
    cfg = run_config(8, "m2po", 1, args)
    assert cfg["data"] == {"path": "builtin:reasoning_gym", "name": "basic_arithmetic", "size": 8192}
    assert cfg["trainer"]["lr"] == 5e-6 and cfg["trainer"]["max_staleness"] == 8 and cfg["trainer"]["seed"] == 1
    assert cfg["eval"]["extra"] == {"deep": [1, 2]} and cfg["eval"]["every"] == 10
