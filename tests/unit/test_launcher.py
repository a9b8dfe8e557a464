"""`pipeline run` starts generators that share a GPU one after another: each waits until the earlier ones
have registered at the hub (or exited). Real child processes (`sleep`), stopped by PID."""

import json
import threading
import time

import pytest

from pipeline.launcher import Child, _wait_registered


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
