"""Helpers for the integration tests: start a learner and generators as real processes."""

from __future__ import annotations

from pathlib import Path

from pipeline.metrics import read_metrics
from tests.conftest import wait_for


def start_learner(procs, run_dir: Path, port: int, overrides: list[str], extra: list[str] = ()) -> object:
    run_dir.mkdir(parents=True, exist_ok=True)
    args = ["learner", "-c", "configs/demo.yaml", "--run-dir", str(run_dir), "--set", f"hub.port={port}"]
    for o in overrides:
        args += ["--set", o]
    return procs([*args, *extra], run_dir.parent / f"{run_dir.name}-learner.log")


def start_generator(procs, run_dir: Path, port: int, overrides: list[str], name: str = "gen"):
    args = ["generator", "-c", "configs/demo.yaml", "--learner", f"tcp://127.0.0.1:{port}"]
    for o in overrides:
        args += ["--set", o]
    return procs(args, run_dir.parent / f"{run_dir.name}-{name}.log")


def wait_steps(run_dir: Path, n: int, timeout: float, watch) -> list[dict]:
    return wait_for(lambda: (lambda r: r if len(r) >= n else None)(read_metrics(run_dir)),
                    timeout, f"{n} learner steps", watch)
