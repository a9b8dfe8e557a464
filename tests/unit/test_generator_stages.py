"""A generator's time by stage (generator/stages.py): profiling changes none of what it sends, and a wait for room
in the window ends as soon as a new version makes room; with the loop's harness of test_generator_loop.py."""

from __future__ import annotations

import asyncio
import json

from hub import leases
from pipeline import trace
from pipeline.config import config_from_dict
from tests.unit.test_generator_loop import FakeEngine, _until, publish, running


async def test_profiling_changes_no_number_a_generator_sends(tmp_path):
    """The same prompts give the same groups (tokens, rewards, versions) with the trace on and off; traced, the
    generator's file holds its leases and each group's generate, score, encode and send."""
    cfg = config_from_dict({"trainer": {"batch_size": 4, "group_size": 2, "max_staleness": 1, "total_steps": 3},
                            "hub": {"heartbeat_s": 0.2}})
    sent = []
    for traced in (False, True):
        if traced:
            trace.start(tmp_path / "trace", "generator")
        try:
            (run_dir := tmp_path / f"run-{traced}").mkdir()
            async with running(cfg, run_dir, FakeEngine()) as (hub, gen):
                await _until(lambda: len(hub.ledger.buffer) >= 8)
                with hub.lock:
                    groups = {(g.epoch, g.prompt_id): [(s.token_ids, s.reward, s.rewards, s.first_version)
                                                       for s in g.samples] for g, *_ in hub.ledger.buffer}
                await _until(lambda: hub.step_stats().stages.get(gen.id, {}).get("score", 0) > 0)
                sent.append(groups)
        finally:
            trace.TRACE.flush()
            trace.TRACE.path = None
    assert sent[0] == sent[1] and len(sent[0]) >= 8
    names = {json.loads(line)["name"] for f in (tmp_path / "trace").glob("*.jsonl") for line in f.open()}
    assert {"lease", "wait_version", "generate", "score", "encode", "send", "weights", "groups generating"} <= names


async def test_a_generator_told_to_wait_asks_again_once_a_new_version_is_loaded(tmp_path, monkeypatch):
    """With the window full the hub says Wait (retry_s); the step that frees room publishes a version, and the
    generator asks again as soon as its engine loads it, not when retry_s is over (a minute here)."""
    monkeypatch.setattr(leases, "WAIT_S", 60.0)
    cfg = config_from_dict({"trainer": {"batch_size": 4, "group_size": 2, "max_staleness": 0, "total_steps": 3},
                            "hub": {"heartbeat_s": 0.2}})
    engine = FakeEngine()
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(hub.ledger.buffer) >= 4)  # the window (k + 1) x 4 is full: told to wait a minute
        await _until(lambda: gen.stages.sums.get("lease", 0) > 0 and not hub.ledger.leases)
        await asyncio.sleep(0.3)
        batch, *_ = await asyncio.to_thread(hub.take_batch, 0)
        assert len(batch) == 4 and not hub.ledger.buffer
        publish(hub, 1)
        await _until(lambda: len(hub.ledger.buffer) >= 4)  # the next batch, at version 1
        with hub.lock:
            assert {min(s.first_version for s in g.samples) for g, *_ in hub.ledger.buffer} == {1}
        gen._on_signal()  # it waits a minute for room again: leave now
        gen._on_signal()
