"""`pipeline run`: a learner and the configured generators as child processes of this one.

Each child runs in its own process session and writes its log to RUN_DIR/logs/; a progress bar follows
RUN_DIR/metrics.jsonl. Children are stopped by PID (their process group): on Ctrl-C, on a failure,
and generators once the learner has finished. On Ctrl-C generators leave at once (two SIGTERMs: no
drain, the run is being abandoned) and the learner removes its shared-memory files; what a child killed
after the grace period could not remove is removed afterwards (`remove_stale`). Signals never interrupt the
launcher's code: they are counted and its loops look (the first stops the run, another cuts the grace period
short), so no second Ctrl-C can leave a child running. Once every child is stopped they are ignored: `pipeline run`
exits 130 after a Ctrl-C however many more came.

Nothing outlives the process that started it: each child has a guard (`guard`, a small process in a session of
its own) that ends the child's process group once the child or its starter is gone, however it went (SIGKILL,
the OOM killer, a CI time-out killing pytest), then removes the /dev/shm files of dead processes. With `run.mps` the
first child is NVIDIA's CUDA MPS control daemon, whose clients the others are; it stops after them (pipeline/mps.py).

A run directory holds one run. A new run refuses a directory that holds one (`check_run_dir`), naming what is
there and the ways on (`--resume`, another `run.name`): a second run of a fixed `run.name` would otherwise read
the first one's metrics and hub.json and append to its files. The learner writes in hub.json the token its
launcher passed, and the launcher takes no other address.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.config import Config, save_config
from pipeline.host import alive, processes
from pipeline.metrics import read_metrics
from pipeline.mps import Mps
from pipeline.netutil import local_address, port_free, reserved_port
from pipeline.trace import merge, trace_dir
from pipeline.verdict import timed, verdict

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # guards run `-m pipeline.launcher` from here
# what a learner writes into its run directory (launch.yaml and logs/ are the launcher's, written before it starts)
RUN_FILES = ("metrics.jsonl", "checkpoints", "hub.json", "config.yaml", "events.jsonl", "changes.jsonl",
             "eval.jsonl", "final")


class RunDirError(Exception):
    """The run directory does not suit the command: it holds a run already, or has no checkpoint to resume."""


GUARDED = "PIPELINE_GUARDED"  # set to 1 for what Child starts: a `pipeline generator` so marked has its guard


class Child:
    """A child process in its own process session (its group holds vLLM's engine processes too), logging
    to `log_path` (None: to this process's stdout and stderr); stopped by PID, never by name. The tests and
    benchmarks start their services with it. Its guard ends the group should the child or this process die without
    stopping it; the child's environment says so (`GUARDED`)."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None, env: dict | None = None, cwd=None,
                 held: bool = False):
        """`held`: the child waits for `go` (a line on its stdin; `pipeline generator --go-on-stdin`)."""
        self.name, self.log_path = name, log_path
        self.log = log_path.open("ab") if log_path is not None else None
        err = subprocess.STDOUT if self.log is not None else None
        env = {**(os.environ if env is None else env), GUARDED: "1"}
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=err, start_new_session=True, env=env, cwd=cwd,
                                     stdin=subprocess.PIPE if held else None)
        # a session of its own: Ctrl-C in a terminal or a signal to either group does not reach it
        self.guard = subprocess.Popen([sys.executable, "-m", "pipeline.launcher", str(os.getpid()), str(self.pid)],
                                      stdout=self.log, stderr=err, start_new_session=True, cwd=PACKAGE_ROOT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def go(self) -> None:
        """Let a `held` child go on. One that has exited meanwhile is seen where its registration is awaited."""
        assert self.proc.stdin is not None, "go: the child was not started held"
        with contextlib.suppress(OSError):
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()

    def stop(self, grace: float = 20.0, now: bool = False) -> int:
        """SIGTERM (twice when `now`: a generator leaves without draining), then SIGKILL to the child's process
        group (it includes vLLM's engine process)."""
        stop_all([self], grace, now)
        return self.proc.returncode

    def tail(self, n: int = 30) -> str:
        if self.log_path is None:
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def stop_all(children: list[Child], grace: float = 20.0, now: bool = False, hurry=lambda: False) -> None:
    """Stop every child's process group: SIGTERM to all at once, SIGKILL to the groups still there after `grace`
    seconds or as soon as `hurry()` is true. Nothing here raises on a signal: once begun, it ends every group."""
    for c in children:
        if c.proc.poll() is None:
            _signal_group(c.pid, signal.SIGTERM)
    if now:
        time.sleep(0.5)
        for c in children:
            if c.proc.poll() is None:
                os.kill(c.pid, signal.SIGTERM)
    _wait(lambda: all(c.proc.poll() is not None for c in children), grace, hurry)
    for c in children:
        if c.proc.poll() is None:
            _signal_group(c.pid, signal.SIGKILL)
        c.proc.wait()
    # the rest of a group ends by itself once its child is gone: Python's resource tracker removes the
    # shared-memory segments vLLM's processes leaked (a SIGKILL would leave them in /dev/shm); else killed
    _wait(lambda: not any(_members(c.pid) for c in children), 10.0, hurry)
    for c in children:
        if _members(c.pid):  # only while it has members: a group's id is not given to another process before
            _signal_group(c.pid, signal.SIGKILL)
    for c in children:  # its guard is done once the group is empty (it sweeps /dev/shm, then exits)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.guard.wait(30)
        if c.log is not None:
            c.log.close()


def _wait(done, timeout: float, hurry=lambda: False) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline or hurry():
            return False
        time.sleep(0.1)
    return True


def _members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`; a zombie (exited, not reaped yet) is not live."""
    return [pid for pid, (state, _, group) in processes().items() if group == pgid and state != "Z"]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def guard(starter: int, leader: int, grace: float = 30.0) -> None:
    """The guard of one child, run as `python -m pipeline.launcher STARTER LEADER` (Child starts it). Once the
    child's starter (this guard's parent) or the child (its group's leader) is gone, whatever ended it, the group
    (vLLM's engine processes, learner ranks) is stopped as on Ctrl-C: SIGTERM, a second to the child (a generator
    leaves without draining: the run is abandoned), SIGKILL after `grace` seconds; then the /dev/shm files of dead
    processes are removed. A SIGKILLed `pipeline run` or generator cannot do this itself, and vLLM's engine core
    outlives a generator killed with SIGKILL. Looks every 0.1 s (one /proc file: the launcher waits for it)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only its own end stops it (a group's leader cannot outlive it anyway)
    while os.getppid() == starter and alive(leader):
        time.sleep(0.1)
    if _members(leader):
        gone = f"its starter (pid {starter})" if os.getppid() != starter else f"pid {leader}"
        _say(f"guard: {gone} is gone; stopping process group {leader}")
        _signal_group(leader, signal.SIGTERM)  # the learner removes its files on SIGTERM, generators leave
        time.sleep(0.5)
        if leader in _members(leader):
            os.kill(leader, signal.SIGTERM)
        if not _wait(lambda: not _members(leader), grace):
            _say(f"guard: SIGKILL to {_members(leader)} after {grace} s")
            _signal_group(leader, signal.SIGKILL)
    # until no process of the group runs (those SIGKILLed above take a moment); zombies are not waited for: an
    # orphan's is init's to reap, which took a second here, and remove_stale takes a zombie for gone
    _wait(lambda: not _members(leader), 10.0)
    from pipeline.host import remove_stale

    remove_stale()  # the folders and vLLM segments of processes that could not remove their own


def _say(message: str) -> None:
    """A guard's line on stderr, which may be a closed terminal or pipe (a standalone generator's): it still goes on."""
    with contextlib.suppress(OSError):
        print(message, file=sys.stderr, flush=True)


def run_dir_of(cfg: Config, explicit: Path | None) -> Path:
    """RUN_DIR: given, or run.dir/run.name (default: a timestamp)."""
    return (explicit or Path(cfg.run.dir) / (cfg.run.name or time.strftime("%Y%m%d-%H%M%S"))).resolve()


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A new run needs a directory without a run in it; `--resume` one with a checkpoint. Else RunDirError,
    naming what is there and the ways on. Nothing is written: the run that is there stays as it was."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    latest = run_dir / "checkpoints" / "latest"
    if resume and not latest.exists():
        raise RunDirError(f"--resume {run_dir}: no checkpoint to resume from ({latest} does not exist)")
    if resume or not found:
        return
    metrics = run_dir / "metrics.jsonl"
    steps = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.exists() else 0
    tag = latest.read_text().strip() if latest.exists() else "none"
    state = "finished" if (run_dir / "final").exists() else "not finished"
    ways = (f"continue it with `pipeline run --resume {run_dir}` (the learner alone: `pipeline learner --resume "
            f"{run_dir}`), or start another with `--set run.name=NEW_NAME` (or `--run-dir DIR`)"
            if latest.exists() else
            "it has no checkpoint to resume from: start another with `--set run.name=NEW_NAME` (or `--run-dir DIR`), "
            "or remove the directory")
    raise RunDirError(f"{run_dir} holds a run already ({steps} steps done, newest checkpoint {tag}, {state}); a new "
                      f"run does not write into another run's directory. Either {ways}")


def launch(cfg: Config, run_dir: Path, resume: bool = False, profile: bool = False) -> int:
    """Run a learner (resumed from RUN_DIR's newest checkpoint when `resume`) and the generators until the learner
    ends; returns the exit code. `run_dir` was checked by `check_run_dir`. `profile`: every process writes its
    timeline to RUN_DIR/trace/, merged into RUN_DIR/trace.json once they are all gone (pipeline/trace.py)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    received: list[int] = []  # signals: counted, never raised (see the module's docstring)
    for sig in (signal.SIGINT, signal.SIGTERM):  # `kill` stops the run like Ctrl-C: children stopped, files removed
        signal.signal(sig, lambda signum, frame: received.append(signum))
    # the hub's port, known before the learner starts: generators on GPUs of their own start beside it. The run's
    # config.yaml records it; a resumed run keeps it where it is still free. Outside the ephemeral range: no other
    # process's socket takes it in the seconds before the learner binds it (pipeline/netutil.py)
    if cfg.hub.port == 0 or (resume and not port_free(cfg.hub.host, cfg.hub.port)):
        cfg.hub.port = reserved_port(cfg.hub.host)
    address = local_address(cfg.hub.host, cfg.hub.port)
    resolved = run_dir / "launch.yaml"
    save_config(cfg, resolved)
    token = secrets.token_hex(8)  # the learner writes it in hub.json: its address, not a stale one, is used
    cli = [sys.executable, "-m", "pipeline"]
    argv = cli + ["learner", "-c", str(resolved), "--run-dir", str(run_dir), "--launch-token", token]
    argv += (["--resume", str(run_dir)] if resume else []) + _gpus(cfg.run.learner_gpus)
    argv += ["--profile"] if profile else []
    children: list[Child] = []
    rc = 1
    mps = Mps(run_dir) if cfg.run.mps else None  # run.mps: the children are clients of a daemon of the run's
    try:
        env = mps.start(Child) if mps is not None else None
        learner = Child("learner", argv, run_dir / "logs" / "learner.log", env=env)
        children.append(learner)
        print(f"run directory: {run_dir}\nlearner pid {learner.pid}, logs in {run_dir / 'logs'}", flush=True)
        built: dict[str | None, list[Child]] = {}  # GPU set -> its generators building their engines or built

        def start(i: int, mine: str | None, held: bool) -> Child:
            argv = cli + ["generator", "-c", str(resolved), "--learner", address] + _gpus(mine)
            argv += ["--profile", str(trace_dir(run_dir))] if profile else []
            argv += ["--go-on-stdin"] if held else ["--build-first"]  # launch.yaml: the run's config
            child = Child(f"generator-{i}", argv, run_dir / "logs" / f"generator-{i}.log", env=env, held=held)
            children.append(child)
            when = ("imports vLLM now, builds its engine once the hub is up and the generators before it on its GPU "
                    "have registered") if held else "beside the learner"
            print(f"generator-{i} pid {child.pid}{f' on GPUs {mine}' if mine else ''}, {when}", flush=True)
            return child

        # every generator starts now: vLLM's imports take 15-30 s, in which the learner brings its hub up. Those whose
        # engine has its KV cache's size from generator.kv_cache_gb, and the first on each GPU set that no learner
        # rank uses, build their engines from launch.yaml meanwhile (generator/spec.py); the others wait to be told
        # (held)
        waiting = []
        for i in range(cfg.run.generators):
            mine = cfg.run.gpus_of(i)
            if cfg.generator.kv_cache_gb or (mine is not None and mine not in built
                                             and not _shares_gpu(mine, cfg.run.learner_gpus)):
                built.setdefault(mine, []).append(start(i, mine, held=False))
            else:
                waiting.append((mine, start(i, mine, held=True)))
        _wait_for_hub(run_dir, learner, token, received)
        for mine, child in waiting:
            # vLLM sizes its KV cache from the GPU memory free at start (generator.kv_cache_gb 0): generators sharing
            # a GPU (the learner's, or a machine without --gpus) build their engines one after another, once the
            # learner's hub is up, or two would count the same free memory, and the learner's as their own
            _wait_registered(run_dir, built.get(mine, []), learner, received=received)
            child.go()
            built.setdefault(mine, []).append(child)
        rc = _follow(cfg, run_dir, learner, [c for c in children if c is not learner], received)
    except KeyboardInterrupt:
        print("\nstopping (Ctrl-C; again to kill the children now)...", flush=True)
        rc = 130
    except RuntimeError as e:
        print(f"pipeline run: {e}", file=sys.stderr)
    finally:
        seen = len(received)  # a signal from here on only hurries the shutdown
        stop_all(children, now=rc != 0, hurry=lambda: len(received) > seen)
        if mps is not None:  # its clients are gone
            mps.stop()
    from pipeline.host import remove_stale

    remove_stale()
    if profile and (merged := merge(run_dir)):
        print(f"timeline: {merged} (open it in ui.perfetto.dev)")
    if rc == 0:
        records = read_metrics(run_dir)
        first, last = records[0]["reward/mean"], records[-1]["reward/mean"]
        print(f"done: {len(records)} steps, reward {first:.3f} -> {last:.3f}, "
              f"{records[-1]['time/elapsed_s']:.0f} s of training")
        # what held it back (pipeline/verdict.py), as the learner's log says
        if bound := verdict(timed(records), cfg.model.lora is not None):
            print(f"bound: {bound.line()}")
        print(f"run directory: {run_dir}  (metrics.jsonl, reward.png, final/)")
    # every child is stopped: a Ctrl-C from here on has nothing to stop, and one that came while the interpreter
    # exits would end it by SIGINT's default action (Python restores it then, but not an ignored one), not with rc
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return rc


def _shares_gpu(gpus: str, learner_gpus: str | int | None) -> bool:
    """Whether the GPU set `gpus` ("2,3") and the learner's overlap (no learner GPUs given: it may use any)."""
    if not learner_gpus:
        return True
    return bool(set(gpus.split(",")) & set(str(learner_gpus).split(",")))


def _stopped(received: Sequence[int]) -> None:
    if received:
        raise KeyboardInterrupt


def _gpus(gpus: str | int | None) -> list[str]:
    return ["--gpus", str(gpus)] if gpus else []


def _wait_for_hub(run_dir: Path, learner: Child, token: str, received: list[int], timeout: float = 600) -> str:
    """The address in RUN_DIR/hub.json once the learner started with `token` has written it; a hub.json without
    the token is another learner's (a resumed run's dead one) and is never used."""
    deadline = time.monotonic() + timeout  # seconds; the first DeepSpeed start compiles an op (~1 min)
    while time.monotonic() < deadline:
        _stopped(received)
        try:
            hub = json.loads((run_dir / "hub.json").read_text())
        except (OSError, ValueError):
            hub = {}
        if hub.get("token") == token:
            return hub["address"]
        if learner.proc.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.proc.returncode}:\n{learner.tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"the learner did not start its hub within {timeout} s:\n{learner.tail()}")


def _wait_registered(run_dir: Path, generators: list[Child], learner: Child, timeout: float = 900,
                     received: Sequence[int] = ()) -> None:
    """Until each of `generators` has registered at the hub (its engine is up) or exited."""
    from pipeline.metrics import read_jsonl

    deadline = time.monotonic() + timeout
    while generators and time.monotonic() < deadline:
        _stopped(received)
        ids = [e["generator"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register"]
        if all(g.proc.poll() is not None or any(f"-{g.pid}-" in i for i in ids) for g in generators):
            return
        if learner.proc.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.proc.returncode}:\n{learner.tail()}")
        time.sleep(0.5)


def _follow(cfg: Config, run_dir: Path, learner: Child, generators: list[Child], received: list[int]) -> int:
    from tqdm import tqdm

    seen = len(read_metrics(run_dir))  # a resumed run's steps so far (the learner cut those after its checkpoint)
    bar = tqdm(total=cfg.trainer.total_steps, initial=seen, desc="steps", unit="step", dynamic_ncols=True)
    while learner.proc.poll() is None:
        _stopped(received)
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
    # they leave on their own once they hear "run complete"
    _wait(lambda: all(g.proc.poll() is not None for g in generators), 30.0, lambda: bool(received))
    return 0


if __name__ == "__main__":  # a child's guard (see Child)
    guard(int(sys.argv[1]), int(sys.argv[2]))
