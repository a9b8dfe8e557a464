"""The generator's lease loop (generator/leases.py) against a real in-process hub, with a fake engine (no vLLM) and
the loop's harness of test_generator_loop.py: how many groups it keeps in flight (`inflight_cap`, the first wave),
whether a wait for room is its engine's or the window's, a lease size set at run time, and a drain or the run's end
reaching a lease that waits for its version or a generator with no room for more."""

from __future__ import annotations

import asyncio

import pytest

from generator.leases import inflight_cap
from pipeline import protocol as P
from pipeline.config import config_from_dict
from tests.unit.test_generator_loop import FakeEngine, _events, _groups, _until, publish, running


class HoldingEngine(FakeEngine):
    """Holds every request until released."""

    def __init__(self, seqs: int):
        super().__init__()
        self.seqs, self.release = seqs, asyncio.Event()

    async def generate(self, prompt_ids, n, sampling, seed=None):
        self.inside += n
        try:
            await self.release.wait()
        finally:
            self.inside -= n
        return await super().generate(prompt_ids, n, sampling, seed)


async def test_groups_in_flight_are_sized_from_what_the_engine_runs_at_once(tmp_path):
    """max_inflight_groups 0: the engine's concurrent sequences over the group size, plus one lease waiting; the
    staleness window (here 4 batches of 8 groups) would allow more, and so would the first wave (10 groups)."""
    cfg = config_from_dict({"trainer": {"batch_size": 8, "group_size": 2, "max_staleness": 3, "total_steps": 100},
                            "generator": {"lease_size": 3}, "hub": {"heartbeat_s": 0.2}})
    engine = HoldingEngine(seqs=7)
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(_groups(gen)) >= 7)
        await asyncio.sleep(0.5)  # room for more leases, if it asked for them
        assert len(_groups(gen)) == 7 == inflight_cap(gen.cfg, engine, 2)  # ceil(7 / 2) + 3
        engine.release.set()
        await _until(lambda: len(hub.ledger.buffer) >= 32)  # released: the whole window fills
        assert len(hub.ledger.buffer) == 32


@pytest.mark.parametrize("seqs, stage", [(4, "engine_full"), (8, "wait_room")])
async def test_a_wait_for_room_with_the_engine_full_is_the_engines_not_the_windows(tmp_path, seqs, stage):
    """k = 0: the window holds one batch, 2 groups of 2 (4 sequences), and the generator asks for one group more (its
    lease). With an engine that runs 4 at once, it waits with its engine full: a wider window would only queue more
    there, so that wait is `engine_full` (pipeline/verdict.py counts it for generation); with room for 8, it is the
    window's (`wait_room`)."""
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 0, "total_steps": 100},
                            "generator": {"lease_size": 1}, "hub": {"heartbeat_s": 0.2}})
    engine = HoldingEngine(seqs=seqs)
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: engine.inside == 4)
        await _until(lambda: gen.stages.report().get(stage, 0.0) > 0.3)
        other = {"engine_full", "wait_room"} - {stage}
        assert gen.stages.report().get(other.pop(), 0.0) == 0.0
        engine.release.set()


class GatedEngine(FakeEngine):
    """Holds every request until `let` lets it through."""

    def __init__(self, seqs: int):
        super().__init__()
        self.seqs, self.gate = seqs, asyncio.Semaphore(0)

    def let(self, n: int) -> None:
        for _ in range(n):
            self.gate.release()

    async def generate(self, prompt_ids, n, sampling, seed=None):
        await self.gate.acquire()
        return await super().generate(prompt_ids, n, sampling, seed)


async def test_the_first_wave_is_a_batch_and_a_quarter_then_the_engine_fills(tmp_path):
    """The learner's first step waits for one batch: until a batch's worth of its groups have ended, a generator keeps
    5/4 of a batch in flight (an engine with fewer sequences finishes them sooner), then as many as its engine runs."""
    cfg = config_from_dict({"trainer": {"batch_size": 8, "group_size": 2, "max_staleness": 7, "total_steps": 100},
                            "generator": {"lease_size": 2}, "hub": {"heartbeat_s": 0.2}})
    engine = GatedEngine(seqs=64)  # 32 groups at once, plus a lease: 34
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(_groups(gen)) >= 10)
        await asyncio.sleep(0.5)  # room for more leases, if it asked for them
        assert len(_groups(gen)) == 10 and inflight_cap(gen.cfg, engine, 2) == 34  # ceil(8 * 5 / 4) of 34
        engine.let(7)  # seven ended: still the first wave
        await _until(lambda: len(hub.ledger.buffer) >= 7)
        await asyncio.sleep(0.5)
        assert len(_groups(gen)) == 10
        engine.let(1)  # a batch's worth ended: the engine fills
        await _until(lambda: len(_groups(gen)) >= 34)
        assert len(_groups(gen)) == 34
        engine.let(1000)


async def test_a_lease_size_set_at_run_time_reaches_the_generators(tmp_path):
    """`pipeline set generator.lease_size=6` acts on generators started with 2 in their own config: they ask for
    what their engine has room for and the hub grants up to its own value."""
    import copy

    cfg = config_from_dict({"trainer": {"batch_size": 8, "group_size": 2, "max_staleness": 0, "total_steps": 5},
                            "generator": {"lease_size": 2}, "hub": {"heartbeat_s": 0.2}})
    sizes = []
    async with running(cfg, tmp_path, FakeEngine(), gen_cfg=copy.deepcopy(cfg)) as (hub, gen):
        grant = hub.ledger.grant
        hub.ledger.grant = lambda lease: (sizes.append(len(lease.items)), grant(lease))
        await _until(lambda: len(hub.ledger.buffer) >= 8)
        assert set(sizes) <= {2}
        with hub.lock:
            reply = hub._on_set_request(P.SetRequest("generator.lease_size", 6))
        assert isinstance(reply, P.SetReply) and gen.cfg.generator.lease_size == 2
        await asyncio.to_thread(hub.take_batch, 0)
        publish(hub, 1)
        await _until(lambda: len(hub.ledger.buffer) >= 8)
        assert 6 in sizes


# ---- issue 32: drains, signals, reconnects and a lost hub ------------------------------------------------------


async def test_a_draining_generator_waiting_for_a_version_returns_its_lease_and_leaves(tmp_path):
    """A lease waits for weights that never come (as for a draining nccl/ipc generator, which takes no more
    broadcasts): the drain ends the wait, the lease goes back with the Leave, and the generator exits 0."""
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 10},
                            "weights": {"transport": "zmq"}, "hub": {"heartbeat_s": 0.2}})
    engine = FakeEngine(version=3, run_id="an-older-run")  # never holds this run's weights: nothing is announced
    async with running(cfg, tmp_path, engine, version=3, announce=False) as (hub, gen):
        # a lease taken, waiting for its weights
        await _until(lambda: hub.ledger.leases and gen.session is not None and gen.session.held)
        leased = sum(len(lease.items) for lease in hub.ledger.leases.values())
        gen._on_signal()
        assert await asyncio.wait_for(gen.task, 10) == 0
        assert gen.id not in hub.registry.generators and not hub.ledger.leases and not hub.ledger.buffer
    leave = next(e for e in _events(tmp_path) if e["event"] == "leave" and e["generator"] == gen.id)
    assert leave["prompts"] == leased > 0  # the lease that could not start went back to the queue


async def test_the_runs_end_reaches_a_generator_with_no_room_for_more(tmp_path):
    """Every group it may hold is running (long completions): it still hears RunComplete, drops what cannot be
    trained any more, leaves and exits 0, within the learner's 15 s wait for its generators."""
    cfg = config_from_dict({"trainer": {"batch_size": 4, "group_size": 2, "max_staleness": 3, "total_steps": 100},
                            "generator": {"lease_size": 2}, "hub": {"heartbeat_s": 0.2}})
    engine = HoldingEngine(seqs=4)  # never finishes a request
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(_groups(gen)) >= 4)  # ceil(4 / 2) + 2: full
        hub.finish_run()
        assert await asyncio.wait_for(gen.task, 10) == 0
        assert gen.id not in hub.registry.generators
