"""The nccl weight transport's code path, on CPU over gloo: one process group per generator, made at
registration (so a generator can join mid-run), each version broadcast into vLLM's workers."""

from __future__ import annotations

import pytest

from pipeline.metrics import read_jsonl
from tests.conftest import wait_for
from tests.integration.helpers import Gate, events, held_at, start_generator, start_learner, wait_steps

pytestmark = pytest.mark.integration


def test_collective_transport_with_a_late_joiner(procs, tmp_path, model_cache, free_port):
    run_dir, release = tmp_path / "nccl", tmp_path / "release"
    steps = 8  # the learner holds after step 3 until the late generator (its engine warm) has joined: mid-run
    common = [f"trainer.total_steps={steps}", "weights.transport=nccl", "trainer.max_staleness=1",
              "weights.collective_timeout_s=60"]
    learner = start_learner(procs, run_dir, free_port, common, env=held_at(3, release))
    with Gate(free_port) as first_gate, Gate(free_port) as late_gate:
        # both engines start side by side; each generator reaches the hub only once its gate opens, so the late one
        # joins mid-run without the run waiting for its engine to start
        first = start_generator(procs, run_dir, first_gate.port, common, "first")
        late = start_generator(procs, run_dir, late_gate.port, common, "late")
        wait_for(lambda: first_gate.knocked.is_set() and late_gate.knocked.is_set(), 600, "both engines to start",
                 [learner, first, late])
        first_gate.open()
        wait_steps(run_dir, 3, 600, [learner, first])
        late_gate.open()
        wait_for(lambda: len(events(run_dir, "register")) == 2, 120, "the late generator to register", [learner, late])
        release.touch()
        wait_for(lambda: len({e["generator"] for e in events(run_dir, "weights_applied") if e["via"] == "nccl"}) == 2,
                 400, "the late generator to receive a broadcast", [learner, first, late])
        assert learner.wait(400) == 0, learner.tail()
        for g in (first, late):
            assert g.wait(60) == 0, g.tail()
    registers = events(run_dir, "register")
    assert [e["transport"] for e in registers] == ["nccl", "nccl"]
    late_id = registers[1]["generator"]
    late_versions = [(e["version"], e["via"]) for e in events(run_dir, "weights_applied") if e["generator"] == late_id]
    # the late joiner is sent the version current when it joined by broadcast too (from the learner's CPU
    # copy), then the new ones as they are trained; it may skip one published while it was joining
    assert registers[1]["version"] > 0 and late_versions[0][0] >= registers[1]["version"]
    assert all(via == "nccl" for _, via in late_versions)
    versions = [v for v, _ in late_versions]
    assert versions == sorted(set(versions)) and versions[-1] == steps
    assert all(b - a <= 2 for a, b in zip(versions, versions[1:], strict=False)), versions
    first_versions = [v for e in events(run_dir, "weights_applied") if e["generator"] == registers[0]["generator"]
                      for v in [e["version"]]]
    # every version, in order, by broadcast; version 0 too: the engine's weights from disk are not the run's
    assert first_versions == list(range(0, steps + 1))
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    assert all(r["staleness/max_lag"] <= 1 for r in records)
