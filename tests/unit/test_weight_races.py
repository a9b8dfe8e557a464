"""Weight versions that the learner replaces while a generator reads them (the file transports), with the generator's
loop against a real in-process hub and a fake engine: a pull slower than two learner steps still applies its
version, a version gone before it is read is skipped for the newest, and neither makes the generator register
again (which dropped its leases and waited out the back-off)."""

from __future__ import annotations

import asyncio
import json

import torch

from pipeline import protocol as P
from pipeline.client import HubClient
from pipeline.config import config_from_dict
from tests.unit.test_generator_loop import FakeEngine, _until, publish, running
from weights.files import FileSender, remove_shm
from weights.plan import checksum, serialize


def _cfg(transport: str):
    return config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 50},
                             "weights": {"transport": transport, "chunk_mb": 1}, "hub": {"heartbeat_s": 0.2}})


WAIT_S = 30  # seconds; generous: a loaded 2-core machine


def _registrations(run_dir) -> int:
    return sum(json.loads(line)["event"] == "register" for line in (run_dir / "events.jsonl").read_text().splitlines())


def _gate_fetches(monkeypatch, version: int, let_through: int):
    """Hold the generator's WeightsFetch requests for `version` after the first `let_through` until `go` is set;
    `served` is set once those went through, `asked` once a request for `version` came."""
    go, served, asked, passed = asyncio.Event(), asyncio.Event(), asyncio.Event(), [0]
    request = HubClient.request

    async def gated(self, msg, timeout=None):
        if isinstance(msg, P.WeightsFetch) and msg.version == version:
            asked.set()
            if passed[0] >= let_through:
                await go.wait()
            reply = await request(self, msg, timeout)
            passed[0] += 1
            if passed[0] == let_through:
                served.set()
            return reply
        return await request(self, msg, timeout)

    monkeypatch.setattr(HubClient, "request", gated)
    return go, served, asked


async def test_a_pull_slower_than_two_learner_steps_still_applies_its_version(tmp_path, monkeypatch):
    """v1 (5 chunks) is being pulled when v2, v3 and v4 are published: the hub keeps v1 until the pull ends, the
    generator applies it, then the newest. (Before: "no longer served" ended the session, every time.)"""
    blob = serialize([("w", torch.arange(1_200_000, dtype=torch.float32))])  # 4.8 MB: 5 chunks of 1 MB
    go, served, _ = _gate_fetches(monkeypatch, 1, let_through=1)
    engine = FakeEngine()
    async with running(_cfg("zmq"), tmp_path, engine) as (hub, gen):
        await _until(lambda: engine.version == 0 and engine.loaded, WAIT_S)
        hub.finish_step(1)
        hub.announce(P.WeightsReady(1, file=P.FileVersion(len(blob), checksum(blob))), blob)
        await asyncio.wait_for(served.wait(), WAIT_S)  # its pull of v1 has begun
        for v in (2, 3, 4):
            publish(hub, v)
        go.set()
        await _until(lambda: engine.version == 4, WAIT_S)
        assert [v for v, _ in engine.loaded] == [0, 1, 4] and engine.loaded[1] == (1, checksum(blob))
        assert _registrations(tmp_path) == 1


async def test_a_version_gone_before_its_pull_begins_is_skipped_for_the_newest(tmp_path, monkeypatch):
    go, _, asked = _gate_fetches(monkeypatch, 1, let_through=0)
    engine = FakeEngine()
    async with running(_cfg("zmq"), tmp_path, engine) as (hub, gen):
        await _until(lambda: engine.version == 0 and engine.loaded, WAIT_S)
        publish(hub, 1)
        await asyncio.wait_for(asked.wait(), WAIT_S)  # the generator asks for v1's first chunk: held
        publish(hub, 2)
        publish(hub, 3)  # v1 is no longer served
        go.set()
        await _until(lambda: engine.version == 3, WAIT_S)
        assert [v for v, _ in engine.loaded] == [0, 3]
        assert _registrations(tmp_path) == 1 and gen.id in hub.registry.generators


class RacingEngine(FakeEngine):
    """A vLLM worker opens the file itself, after the generator checked it: two more versions are published in
    between, and the learner removes the file of the one being loaded."""

    def __init__(self, publish_before_open):
        super().__init__()
        self.publish_before_open = publish_before_open

    async def swap(self, version, method, *args):
        if version == 1:
            self.publish_before_open()
        return await super().swap(version, method, *args)


async def test_an_shm_file_removed_while_the_generator_loads_it_is_loaded_without_registering_again(tmp_path):
    run_id = f"unit-race-{tmp_path.name}"
    weights = torch.arange(1000, dtype=torch.float32)
    holder = {}

    def newer_versions():
        for v in (2, 3):
            holder["hub"].finish_step(v)
            holder["sender"].send(v, [("w", weights + v)], 0.0)

    engine = RacingEngine(newer_versions)
    cfg = _cfg("shm")
    try:
        async with running(cfg, tmp_path, engine, announce=False) as (hub, gen):
            sender = holder["sender"] = FileSender(cfg, hub, run_id)
            holder["hub"] = hub
            sender.send(0, [("w", weights)], 0.0)
            await _until(lambda: engine.version == 0 and engine.loaded, WAIT_S)
            hub.finish_step(1)
            sender.send(1, [("w", weights + 1)], 0.0)
            await _until(lambda: engine.version == 3, WAIT_S)
            assert [v for v, _ in engine.loaded] == [0, 1, 3] and gen.session.receiver.via == "shm"
            assert engine.loaded[1] == (1, checksum(serialize([("w", weights + 1)])))
            assert _registrations(tmp_path) == 1
    finally:
        remove_shm(run_id)
