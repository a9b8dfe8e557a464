"""Generators join, die and drain while a run goes on, and the learner is killed and resumed.

One epoch of the dataset is trained exactly once across all of it: the ledger in the final
checkpoint holds every prompt id once, the version sequence is unbroken, the bound holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.metrics import read_jsonl
from tests.conftest import wait_for
from tests.integration.helpers import start_generator, start_learner

pytestmark = pytest.mark.integration

# long enough (about 150 steps) that generators starting on 2 busy cores join mid-run
PROMPTS, BATCH, GROUP, K = 1200, 8, 16, 2  # K: the bound after `pipeline set` raises it from 1 to 2
STEPS = PROMPTS // BATCH


def _registered(run_dir, after: int = 0) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl")[after:] if e["event"] == "register"]


def _trained_by(run_dir, gen_id: str) -> list[list]:
    return [t for r in read_jsonl(run_dir / "metrics.jsonl") for t in r["trained"] if t[3] == gen_id]


def _steps(run_dir) -> int:
    return len(read_jsonl(run_dir / "metrics.jsonl"))


def test_joins_kills_drain_and_learner_resume(procs, tmp_path, model_cache, free_port):
    run_dir = tmp_path / "elastic"
    common = [f"trainer.total_steps={STEPS}", "trainer.epochs=1", f"data.size={PROMPTS}",
              f"trainer.batch_size={BATCH}", f"trainer.group_size={GROUP}", "trainer.max_staleness=1",
              "trainer.checkpoint_every=1", "hub.heartbeat_s=0.5", "hub.heartbeat_timeout_s=4",
              "generator.max_inflight_groups=8"]
    timeline = []
    learner = start_learner(procs, run_dir, free_port, common)
    gen_a = start_generator(procs, run_dir, free_port, common, "a")
    wait_for(lambda: _steps(run_dir) >= 2, 400, "the first steps", [learner, gen_a])
    timeline.append(f"step {_steps(run_dir)}: generators b and c started")
    gen_b = start_generator(procs, run_dir, free_port, common, "b")
    gen_c = start_generator(procs, run_dir, free_port, common, "c")
    watch = [learner, gen_a, gen_b, gen_c]
    wait_for(lambda: len(_registered(run_dir)) >= 3, 400, "b and c to register", watch)
    joins = _registered(run_dir)[1:]
    timeline += [f"{e['generator']} registered at version {e['version']}" for e in joins]
    assert all(e["version"] > 0 for e in joins), "the joins must happen mid-run"
    id_b = next(e["generator"] for e in joins if f"-{gen_b.pid}-" in e["generator"])
    id_c = next(e["generator"] for e in joins if f"-{gen_c.pid}-" in e["generator"])
    wait_for(lambda: _trained_by(run_dir, id_b) and _trained_by(run_dir, id_c), 300, "b and c to contribute", watch)
    # a joining generator's rollouts come from the learner's current weights (the newest announced
    # when it registered), not version 0
    for gid in (id_b, id_c):
        current = next(e["weights"] for e in joins if e["generator"] == gid)
        assert current > 0 and min(t[2] for t in _trained_by(run_dir, gid)) >= current

    # see it and tune it while it runs
    hub = f"tcp://127.0.0.1:{free_port}"
    status = _cli("status", "--learner", hub)
    assert status.returncode == 0 and all(g in status.stdout for g in (id_b, id_c)), status
    changed = _cli("set", "--learner", hub, "trainer.max_staleness=2", "sampling.temperature=0.9")
    assert changed.returncode == 0, changed.stderr
    from_step = int(changed.stdout.split("from step ")[1].split(")")[0])
    refused = _cli("set", "--learner", hub, "trainer.batch_size=4")
    assert refused.returncode == 2 and "cannot change while a run goes on" in refused.stderr
    unknown = _cli("set", "--learner", hub, "trainer.bogus=1")
    assert unknown.returncode == 2 and "trainer.bogus: unknown field" in unknown.stderr
    wait_for(lambda: _steps(run_dir) >= from_step + 2, 120, "steps after the change", [learner])
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert all(r["max_staleness"] == 2 for r in records[from_step + 1:])  # applied within one step
    changes = read_jsonl(run_dir / "changes.jsonl")
    assert [c["key"] for c in changes] == ["trainer.max_staleness", "sampling.temperature"]
    timeline.append(f"step {_steps(run_dir)}: pipeline set trainer.max_staleness=2 (from step {from_step})")

    # freeze b while it holds a lease, then SIGKILL it: its leased prompts must go back to the queue
    deadline = time.monotonic() + 120
    while True:
        os.killpg(gen_b.pid, signal.SIGSTOP)
        rows = {g["id"]: g for g in request_once(hub, P.StatusRequest()).info["generators"]}
        if rows[id_b]["leases"] > 0 or time.monotonic() > deadline:
            break
        os.killpg(gen_b.pid, signal.SIGCONT)
        time.sleep(0.2)
    assert rows[id_b]["leases"] > 0, "b never held a lease"
    gen_b.stop(grace=0)  # SIGKILL to the whole process group
    timeline.append(f"step {_steps(run_dir)}: b killed (SIGKILL) holding {rows[id_b]['leases']} lease(s)")
    gen_c.signal(signal.SIGTERM)
    assert gen_c.wait(120) == 0, gen_c.tail()
    timeline.append(f"step {_steps(run_dir)}: c drained and left")
    requeue = wait_for(lambda: [e for e in read_jsonl(run_dir / "events.jsonl")
                                if e["event"] == "requeue" and e["generator"] == id_b], 60, "b to be declared dead",
                       [learner])[0]
    assert requeue["prompts"] > 0
    timeline.append(f"step {_steps(run_dir)}: b declared dead, its {requeue['prompts']} leased prompts re-queued")

    stop_at = _steps(run_dir) + 3
    wait_for(lambda: _steps(run_dir) >= stop_at, 300, "more steps", [learner, gen_a])
    learner.stop(grace=0)
    timeline.append(f"step {_steps(run_dir)}: learner killed (SIGKILL)")
    n_events = len(read_jsonl(run_dir / "events.jsonl"))
    resumed = start_learner(procs, run_dir, free_port, common, ["--resume", str(run_dir)])
    wait_for(lambda: _registered(run_dir, n_events), 300, "a to reconnect to the resumed learner", [resumed, gen_a])
    timeline.append(f"learner resumed at version {_registered(run_dir, n_events)[0]['version']}; a reconnected")
    assert resumed.wait(600) == 0, resumed.tail()
    assert gen_a.wait(60) == 0, gen_a.tail()  # it leaves once the run is complete

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))  # unbroken versions after the resume
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["staleness/max_lag"] <= K for r in records)
    trained = [(t[0], t[1]) for r in records for t in r["trained"]]
    ledger = json.loads((run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text() / "hub.json")
                        .read_text())
    expected = {(0, pid) for pid in range(PROMPTS)}
    assert len(trained) == len(set(trained)) == PROMPTS and set(trained) == expected
    assert {tuple(k) for k in ledger["trained"]} == expected and len(ledger["trained"]) == PROMPTS
    counters = records[-1]
    summary = {k: counters[f"hub/{k}"] for k in ("requeued", "duplicates", "unknown_lease", "stale_dropped")}
    assert summary["requeued"] >= requeue["prompts"]  # the counters survived the learner's restart
    print("timeline:\n  " + "\n  ".join(timeline))
    print(f"prompts {PROMPTS}, trained {len(trained)}, counters after resume {summary}")

    # pipeline status against a finished learner: a clear error, not a hang
    out = _cli("status", "--learner", hub)
    assert out.returncode == 1 and "no reply from the learner" in out.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=60)
