"""`pipeline run`: a learner and the configured generators as child processes of this one.

Each child runs in its own process session and writes its log to RUN_DIR/logs/; a progress bar follows
RUN_DIR/metrics.jsonl. Children are stopped by PID (their process group): on Ctrl-C, on a failure,
and generators once the learner has finished. On Ctrl-C generators leave at once (two SIGTERMs: no
drain, the run is being abandoned) and the learner removes its shared-memory files; what a child killed
after the grace period could not remove is removed afterwards (`remove_stale`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.config import Config, save_config
from pipeline.metrics import read_metrics


class Child:
    """A child process in its own process session (its group holds vLLM's engine processes too), logging
    to `log_path`; stopped by PID, never by name. The tests and benchmarks start their services with it."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None, cwd=None):
        self.name, self.log_path = name, log_path
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env, cwd=cwd)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace: float = 20.0, now: bool = False) -> int:
        """SIGTERM (twice when `now`: a generator leaves without draining), then SIGKILL to the child's process
        group (it includes vLLM's engine process)."""
        if self.proc.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            if now:
                time.sleep(0.5)
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self.proc.wait()
        # the rest of the group ends by itself once the child is gone: Python's resource tracker removes the
        # shared-memory segments vLLM's processes leaked (a SIGKILL would leave them in /dev/shm); else killed
        if not _group_gone(self.pid, timeout=10.0):
            _signal_group(self.pid, signal.SIGKILL)
        self.log.close()
        return self.proc.returncode

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def make_run_dir(cfg, explicit: Path | None) -> Path:
    """RUN_DIR: given, or run.dir/run.name (default: a timestamp)."""
    run_dir = explicit or Path(cfg.run.dir) / (cfg.run.name or time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve()


def launch(cfg: Config, config_path: str | None, overrides: list[str], run_dir: Path | None) -> int:
    run_dir = make_run_dir(cfg, run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the run like Ctrl-C: children stopped, files removed
    resolved = run_dir / "launch.yaml"
    save_config(cfg, resolved)
    cli = [sys.executable, "-m", "pipeline.cli"]
    learner = Child("learner", cli + ["learner", "-c", str(resolved), "--run-dir", str(run_dir)]
                    + _gpus(cfg.run.learner_gpus), run_dir / "logs" / "learner.log")
    children = [learner]
    print(f"run directory: {run_dir}\nlearner pid {learner.pid}, logs in {run_dir / 'logs'}", flush=True)
    try:
        address = _wait_for_hub(run_dir, learner)
        gpus = cfg.run.generator_gpus
        started: dict[str | None, list[Child]] = {}  # GPU set -> its generators so far
        for i in range(cfg.run.generators):
            mine = gpus[i % len(gpus)] if gpus else None
            argv = cli + ["generator", "-c", str(resolved), "--learner", address] + _gpus(mine)
            # vLLM sizes its KV cache from the GPU memory free at start: generators sharing a GPU (or a
            # machine, without --gpus) start one after another, or two would count the same free memory
            _wait_registered(run_dir, started.get(mine, []), learner)
            child = Child(f"generator-{i}", argv, run_dir / "logs" / f"generator-{i}.log")
            started.setdefault(mine, []).append(child)
            children.append(child)
        rc = _follow(cfg, run_dir, learner, children[1:])
    except KeyboardInterrupt:
        print("\nstopping (Ctrl-C)...", flush=True)
        rc = 130
    except RuntimeError as e:
        print(f"pipeline run: {e}", file=sys.stderr)
        rc = 1
    for child in reversed(children):
        child.stop(now=rc != 0)
    from weights.files import remove_stale

    remove_stale()
    if rc == 0:
        records = read_metrics(run_dir)
        first, last = records[0]["reward/mean"], records[-1]["reward/mean"]
        print(f"done: {len(records)} steps, reward {first:.3f} -> {last:.3f}, "
              f"{records[-1]['time/elapsed_s']:.0f} s of training")
        print(f"run directory: {run_dir}  (metrics.jsonl, reward.png, final/)")
    return rc


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _gpus(gpus: str | None) -> list[str]:
    return ["--gpus", gpus] if gpus else []


def _wait_for_hub(run_dir: Path, learner: Child, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout  # seconds; the first DeepSpeed start compiles an op (~1 min)
    while time.monotonic() < deadline:
        if (run_dir / "hub.json").exists():
            return json.loads((run_dir / "hub.json").read_text())["address"]
        if learner.proc.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.proc.returncode}:\n{learner.tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"the learner did not start its hub within {timeout} s:\n{learner.tail()}")


def _wait_registered(run_dir: Path, generators: list[Child], learner: Child, timeout: float = 900) -> None:
    """Until each of `generators` has registered at the hub (its engine is up) or exited."""
    from pipeline.metrics import read_jsonl

    deadline = time.monotonic() + timeout
    while generators and time.monotonic() < deadline:
        ids = [e["generator"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register"]
        if all(g.proc.poll() is not None or any(f"-{g.pid}-" in i for i in ids) for g in generators):
            return
        if learner.proc.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.proc.returncode}:\n{learner.tail()}")
        time.sleep(0.5)


def _follow(cfg: Config, run_dir: Path, learner: Child, generators: list[Child]) -> int:
    from tqdm import tqdm

    bar = tqdm(total=cfg.trainer.total_steps, desc="steps", unit="step", dynamic_ncols=True)
    seen = 0
    while learner.proc.poll() is None:
        records = read_metrics(run_dir)
        if len(records) > seen:
            r = records[-1]
            bar.update(len(records) - seen)
            seen = len(records)
            bar.set_postfix(reward=f"{r['reward/mean']:.3f}", lag=r["staleness/max_lag"],
                            tok_s=f"{r['throughput/tokens_per_s']:.0f}", wait=f"{r['time/wait_s']:.2f}s")
        dead = [g for g in generators if g.proc.poll() is not None and g.proc.returncode != 0]
        if dead and len(dead) == len(generators):
            raise RuntimeError(f"every generator exited; {dead[0].name}'s log:\n{dead[0].tail()}")
        time.sleep(0.5)
    bar.update(len(read_metrics(run_dir)) - seen)
    bar.close()
    if learner.proc.returncode != 0:
        raise RuntimeError(f"the learner exited with {learner.proc.returncode}:\n{learner.tail()}")
    for g in generators:  # they leave on their own once they hear "run complete"
        try:
            g.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    return 0
