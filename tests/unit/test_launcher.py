"""`pipeline run`'s launcher with stand-in children (`sleep`, small scripts), stopped by PID: generators that share
a GPU start one after another, a stale hub.json is not taken, and signals during the shutdown leave no child."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipeline.launcher import Child, _wait_registered
from tests.conftest import REPO, running, wait_for


def _register(run_dir, child, delay):
    time.sleep(delay)
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps({"event": "register", "generator": f"gen-host-{child.pid}-abc"}) + "\n")


def test_waits_for_the_earlier_generators_to_register(tmp_path):
    learner = Child("learner", ["sleep", "60"], tmp_path / "learner.log")
    first = Child("generator-0", ["sleep", "60"], tmp_path / "g0.log")
    done = Child("generator-1", ["true"], tmp_path / "g1.log")  # exited: not waited for
    try:
        done.proc.wait(10)
        (tmp_path / "events.jsonl").write_text(json.dumps({"event": "register", "generator": "gen-host-1-x"}) + "\n")
        writer = threading.Thread(target=_register, args=(tmp_path, first, 1.5))
        writer.start()
        _wait_registered(tmp_path, [first, done], learner)
        registered = [json.loads(line)["generator"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert f"gen-host-{first.pid}-abc" in registered  # it returned only after the register event
        writer.join()
    finally:
        for c in (learner, first, done):
            c.stop(grace=1)


def test_a_dead_learner_ends_the_wait(tmp_path):
    learner = Child("learner", ["sh", "-c", "echo hub failed; exit 3"], tmp_path / "learner.log")
    first = Child("generator-0", ["sleep", "60"], tmp_path / "g0.log")
    try:
        learner.proc.wait(10)
        (tmp_path / "events.jsonl").write_text("")
        with pytest.raises(RuntimeError, match="learner exited with 3"):
            _wait_registered(tmp_path, [first], learner)
    finally:
        for c in (learner, first):
            c.stop(grace=1)


def test_a_stale_hub_json_is_never_taken_for_the_learners(tmp_path):
    """A resumed run's directory holds the dead learner's hub.json: the launcher waits for the one written by the
    learner it started (the token it passed), however early it looks."""
    from pipeline.launcher import _wait_for_hub

    learner = Child("learner", ["sleep", "60"], tmp_path / "learner.log")
    try:
        (tmp_path / "hub.json").write_text(json.dumps({"address": "tcp://127.0.0.1:1", "pid": 1, "run_id": "old"}))
        with pytest.raises(RuntimeError, match="did not start its hub"):
            _wait_for_hub(tmp_path, learner, "t0k3n", [], timeout=1.5)
        (tmp_path / "hub.json").write_text(json.dumps({"address": "tcp://127.0.0.1:2", "token": "t0k3n"}))
        assert _wait_for_hub(tmp_path, learner, "t0k3n", []) == "tcp://127.0.0.1:2"
    finally:
        learner.stop(grace=1)


# `pipeline run` whose learner and generator are stand-ins that ignore SIGTERM: only SIGKILL ends them
_FAKE_CHILD = """
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
argv = sys.argv[1:]
if "learner" in argv:
    hub = {"address": "tcp://127.0.0.1:1", "token": argv[argv.index("--launch-token") + 1]}
    open(argv[argv.index("--run-dir") + 1] + "/hub.json", "w").write(json.dumps(hub))
print("started", os.getpid(), flush=True)
time.sleep(600)
"""


def _run_with(child: str, *overrides: str) -> str:
    """A program that runs `pipeline run` (pipeline.launcher.launch, RUN_DIR its argument) with the default config and
    `overrides`, every child it starts replaced by the script `child`, given the child's own arguments."""
    return f"""
import sys
from pathlib import Path

import pipeline.launcher as launcher
from pipeline.config import load_config


class StandIn(launcher.Child):
    def __init__(self, name, argv, log_path, env=None, cwd=None, held=False):
        super().__init__(name, [sys.executable, "-c", {child!r}, *argv[3:]], log_path, env, cwd, held)


launcher.Child = StandIn
sys.exit(launcher.launch(load_config(None, {["run.tensorboard=false", *overrides]!r}), Path(sys.argv[1])))
"""


def test_ctrl_c_during_the_shutdown_still_stops_every_child(tmp_path):
    """Ctrl-C stops the run; more Ctrl-Cs while the children are being stopped cut the grace period short, never the
    shutdown: when `pipeline run` exits, no child of it runs (the learner, stopped last before, was left running)."""
    out = tmp_path / "run.out"
    with out.open("wb") as f:
        run = subprocess.Popen([sys.executable, "-c", _run_with(_FAKE_CHILD), str(tmp_path)], stdout=f,
                               stderr=subprocess.STDOUT, cwd=REPO)
    pids = []
    try:
        logs = [tmp_path / "logs" / "learner.log", tmp_path / "logs" / "generator-0.log"]
        wait_for(lambda: all(log.exists() and "started" in log.read_text() for log in logs), 60,
                 "the learner and the generator", [])
        pids = [int(line.split()[1]) for log in logs for line in log.read_text().splitlines()
                if line.startswith("started")]
        run.send_signal(signal.SIGINT)
        wait_for(lambda: "stopping" in out.read_text(), 30, "the shutdown to begin", [])
        deadline = time.monotonic() + 60
        while run.poll() is None and time.monotonic() < deadline:  # Ctrl-C held down, until it has exited: one
            run.send_signal(signal.SIGINT)  # came while Python exited and ended it by SIGINT's default (rc -2)
            time.sleep(0.02)
        assert run.wait(5) == 130, out.read_text()
        assert len(pids) == 2 and not [p for p in pids if running(p)], out.read_text()
    finally:
        if run.poll() is None:
            run.kill()
        for p in pids:
            if running(p):
                os.kill(p, signal.SIGKILL)


# `pipeline run` with two generators sharing the learner's GPU (no GPUs named), both stand-ins: the learner writes its
# hub.json after 3 s, each generator logs when it started and when it was told to go on, then registers a second later
_STAND_INS = """
import json, os, sys, time
argv = sys.argv[1:]
run_dir = argv[argv.index("-c") + 1].rsplit("/", 1)[0]
print("started", time.time(), flush=True)
print("argv", *argv, flush=True)
if "learner" in argv:
    time.sleep(3)
    hub = {"address": "tcp://127.0.0.1:1", "token": argv[argv.index("--launch-token") + 1]}
    open(argv[argv.index("--run-dir") + 1] + "/hub.json", "w").write(json.dumps(hub))
    print("hub", time.time(), flush=True)
    while open(run_dir + "/events.jsonl").read().count("register") < 2 if os.path.exists(run_dir + "/events.jsonl") \\
            else True:
        time.sleep(0.1)
    sys.exit(3)
if "--go-on-stdin" in argv:
    told = sys.stdin.readline()
    print("go", time.time(), repr(told), flush=True)
time.sleep(1)
with open(run_dir + "/events.jsonl", "a") as f:
    f.write(json.dumps({"event": "register", "generator": f"gen-host-{os.getpid()}-x", "time": time.time()}) + "\\n")
time.sleep(600)
"""

def test_generators_sharing_a_gpu_start_at_launch_and_build_one_after_another(tmp_path):
    """Every generator's process starts with the learner's (vLLM's imports overlap the learner's start); those that
    share a GPU are told to go on one at a time: the first once the hub is up, the next once the first registered."""
    out = tmp_path / "run.out"
    with out.open("wb") as f:
        run = subprocess.run([sys.executable, "-c", _run_with(_STAND_INS, "run.generators=2"), str(tmp_path)],
                             stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=120)
    text = out.read_text()
    assert run.returncode == 1 and "the learner exited with 3" in text, text

    def times(name: str) -> dict[str, float]:
        lines = (tmp_path / "logs" / f"{name}.log").read_text().splitlines()
        return {line.split()[0]: float(line.split()[1]) for line in lines if line.split()[0] in ("started", "hub",
                                                                                                "go")}

    learner, g0, g1 = times("learner"), times("generator-0"), times("generator-1")
    registered = {e["generator"]: e["time"] for e in map(json.loads, (tmp_path / "events.jsonl").read_text()
                                                         .splitlines())}
    assert g0["started"] < learner["hub"] and g1["started"] < learner["hub"], (learner, g0, g1)
    assert learner["hub"] <= g0["go"] < g1["go"], (learner, g0, g1)
    (first,) = [t for g, t in registered.items() if t < g1["go"]]  # generator-0's, before generator-1 went on
    assert first >= g0["go"] and "builds its engine once the hub is up" in text


def test_a_held_generator_whose_launcher_is_gone_leaves_at_once(tmp_path):
    """`pipeline generator --go-on-stdin` whose stdin ends before the word to go on (its launcher died): it leaves
    with code 1 and says why, rather than asking a hub that may never come."""
    env = {**os.environ, "PIPELINE_GUARDED": "1"}  # as `pipeline run` starts it: no supervisor of its own
    out = subprocess.run([sys.executable, "-m", "pipeline", "generator", "--learner", "tcp://127.0.0.1:9",
                          "--go-on-stdin"], stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "its launcher ended before telling it to go on" in out.stderr


def test_generators_with_a_fixed_kv_cache_build_at_once(tmp_path):
    """generator.kv_cache_gb: no engine sizes its KV cache from the memory it finds free, so no generator sharing the
    learner's GPU is held: both build at launch, beside the learner's start (neither waits for a word to go on)."""
    out = tmp_path / "run.out"
    with out.open("wb") as f:
        run = subprocess.run([sys.executable, "-c", _run_with(_STAND_INS, "run.generators=2",
                                                              "generator.kv_cache_gb=1"), str(tmp_path)],
                             stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=120)
    text = out.read_text()
    assert run.returncode == 1 and "the learner exited with 3" in text, text
    registered = [json.loads(line)["time"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    hub = [float(line.split()[1]) for line in (tmp_path / "logs" / "learner.log").read_text().splitlines()
           if line.startswith("hub")]
    assert len(registered) == 2 and hub and max(registered) < hub[0], (registered, hub, text)
    for i in (0, 1):
        assert "go" not in [line.split()[0] for line in (tmp_path / "logs" / f"generator-{i}.log").read_text()
                            .splitlines()], text
        assert "--build-first" in (tmp_path / "logs" / f"generator-{i}.log").read_text()  # launch.yaml is the run's
    assert "beside the learner" in text and "builds its engine once the hub is up" not in text
