"""The generator's asyncio loop against a real in-process hub, with a fake engine (no vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref

import pytest
import torch

from generator.engine import Completion
from generator.engines import Fixed
from generator.service import Generator
from hub.hub import Hub, HubStopped
from hub.registry import GeneratorInfo
from pipeline import protocol as P
from pipeline.config import config_from_dict
from pipeline.host import remove_receiver_dir
from pipeline.tasks import echo_rows
from tests.unit.peers import VOCAB, encode
from weights import senders
from weights.base import Receiver
from weights.nccl import NcclReceiver
from weights.plan import checksum, serialize


class FakeEngine:
    """Answers every prompt with the prompt's first token repeated; 'loads' weights by recording them."""

    def __init__(self, version: int = 0, run_id: str = ""):
        self.version, self.run_id = version, run_id
        self.loaded: list[tuple[int, int]] = []
        self.last_swap_ms: dict[str, float] = {}
        self.is_dead = False
        self.seqs = 64  # sequences it runs at once
        self.inside = 0  # sequences held inside it (HoldingEngine)
        self.staging = False  # nccl: no staged receive
        self.started: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # as Engine.started_under reads it

    def concurrent_sequences(self) -> int:
        return self.seqs

    def full(self) -> bool:
        return self.inside >= self.seqs

    def tokens_in_flight(self) -> int:
        return 0

    def dead(self) -> bool:
        return self.is_dead

    def death(self) -> str:
        return "; engine core exit codes [-9]"

    def started_under(self, task):
        return self.started.get(task)

    async def generate(self, prompt_ids, n, sampling, seed=None):
        v = self.version
        self.started.setdefault(asyncio.current_task(), v)
        await asyncio.sleep(0.01)
        return [Completion([prompt_ids[0]] * 4, [-0.5] * 4, "length", v, v, 1.0) for _ in range(n)]

    async def swap(self, version, method, source, crc32):
        assert method == "load_weights_blob" and crc32 is None  # the receiver verified the file before the pause
        with open(source, "rb") as f:
            self.loaded.append((version, checksum(f.read())))
        self.version = version
        return 1.0


class FakeTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [4 + int(c) for c in text.split() if c.isdigit()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i - 4) for i in ids)


def _groups(gen) -> dict:
    """The groups in flight of its session (none between sessions)."""
    return gen.session.groups if gen.session is not None else {}


async def _until(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _blob(version: int) -> bytes:
    return serialize([("w", torch.full((4,), float(version)))])


def publish(hub, version: int) -> bytes:
    blob = _blob(version)
    hub.finish_step(version)
    hub.announce(P.WeightsReady(version, file=P.FileVersion(len(blob), checksum(blob))), blob)
    return blob


@contextlib.asynccontextmanager
async def running(cfg, run_dir, engine, rows=None, version: int = 0, announce: bool = True, gen_cfg=None):
    """A hub in its thread (its weights `version` published, as the learner does at its start) and a generator
    on this loop (with `gen_cfg`, a config of its own, as a separate process has); the generator leaves and the hub
    stops afterwards."""
    hub = Hub(cfg, rows or echo_rows(32, 0), run_dir, "unit", version, encode=encode, vocab_size=VOCAB)
    hub.serve_weights(senders(cfg, hub, "unit"))
    hub.start()
    if announce:
        publish(hub, version)
    gen = Generator(gen_cfg or cfg, Fixed(engine, FakeTokenizer()), hub.address)
    task = asyncio.create_task(gen.run(handle_signals=False))
    gen.task = task
    try:
        yield hub, gen
    finally:
        gen.stopping = 2
        await asyncio.wait_for(task, 30)  # (generous: a loaded CI machine)
        hub.stop()
        remove_receiver_dir()  # what main() does when a generator process ends


async def test_generator_leases_generates_and_follows_weight_versions(tmp_path):
    cfg = config_from_dict({"trainer": {"batch_size": 4, "group_size": 2, "max_staleness": 1, "total_steps": 3},
                            "weights": {"transport": "zmq", "chunk_mb": 1}, "hub": {"heartbeat_s": 0.2}})
    engine = FakeEngine()
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(hub.ledger.buffer) >= 8)  # (k + 1) * batch_size groups, then the window is full
        batch, *_ = await asyncio.to_thread(hub.take_batch, 0)
        assert len(batch) == 4
        for g in batch:  # rewards computed by the generator: 4 echoed digits of the 8 the echo task scores
            assert g.samples[0].reward == 4 / 8 and P.unpack_ints(g.prompt_ids)[0] == P.unpack_ints(
                g.samples[0].token_ids)[0]
        # version 1: a 3 MB blob pulled over the control channel in 1 MB chunks and checked
        blob = serialize([("w", torch.arange(750_000, dtype=torch.float32))])
        hub.finish_step(1)
        hub.announce(P.WeightsReady(1, file=P.FileVersion(len(blob), checksum(blob))), blob)
        await _until(lambda: engine.version == 1 and hub.registry.generators[gen.id].version == 1)
        assert engine.loaded == [(0, checksum(_blob(0))), (1, checksum(blob))]  # the run's v0 first
        await _until(lambda: any(behaviour == 1 for behaviour in
                                 [min(s.first_version for s in g.samples) for g, *_ in hub.ledger.buffer]))
        applied = [line for line in (tmp_path / "events.jsonl").read_text().splitlines() if "weights_applied" in line]
        assert len(applied) == 2
    assert gen.id not in hub.registry.generators  # it said goodbye


async def test_generator_reregisters_when_the_hub_forgets_it(tmp_path):
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "total_steps": 5},
                            "hub": {"heartbeat_s": 0.1}})
    async with running(cfg, tmp_path, FakeEngine()) as (hub, gen):
        await _until(lambda: gen.id in hub.registry.generators)
        with hub.lock:  # as after a heartbeat timeout: the hub drops it and re-queues its leases
            hub.membership.drop(gen.id, "heartbeat timeout")
        await _until(lambda: gen.id in hub.registry.generators)  # told "register again", it did
        registers = [line for line in (tmp_path / "events.jsonl").read_text().splitlines() if '"register"' in line]
        assert len(registers) == 2


async def test_a_drain_is_reported_at_once_and_takes_no_more_broadcasts(tmp_path):
    """The first SIGTERM: the hub hears of the drain before the generator leaves, long before the next periodic
    heartbeat, so the learner stops broadcasting to it; a broadcast announced meanwhile is not received."""
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 50},
                            "hub": {"heartbeat_s": 30, "heartbeat_timeout_s": 60}})
    engine = FakeEngine()
    engine.collective_loads = []
    fast = engine.generate

    async def generate(*args, **kw):  # groups stay in flight long enough to drain
        await asyncio.sleep(1.0)
        return await fast(*args, **kw)

    load_file = engine.swap

    async def swap(version, method, *args):  # nccl, once it is one: unstaged, inside the swap
        if method != "load_weights_collective":
            return await load_file(version, method, *args)
        engine.collective_loads.append(version)
        return 1.0

    engine.generate, engine.swap = generate, swap
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: _groups(gen))
        gen.session.receiver = NcclReceiver()  # as an nccl generator
        gen._on_signal()
        await _until(lambda: hub.registry.generators.get(gen.id) is None or hub.registry.generators[gen.id].draining)
        gen.session.announced.put_nowait(P.WeightsReady(7, manifest=[["w", "float32", [4]]]))
        await _until(lambda: gen.id not in hub.registry.generators)  # it finished its groups and left
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    mine = [e["event"] for e in events if e.get("generator") == gen.id and e["event"] in ("drain", "leave")]
    assert mine == ["drain", "leave"]
    assert engine.collective_loads == []


class FlakyEngine(FakeEngine):
    """Fails the first request for prompts starting with `bad_first` (an engine failure, not the prompt's)."""

    def __init__(self, bad_first: int):
        super().__init__()
        self.bad_first, self.failed = bad_first, 0

    async def generate(self, prompt_ids, n, sampling, seed=None):
        if prompt_ids[0] == self.bad_first and not self.failed:
            self.failed += 1
            raise RuntimeError("engine hiccup")
        return await super().generate(prompt_ids, n, sampling, seed)


async def test_failed_groups_are_leased_again_or_rejected_never_lost(tmp_path):
    """An engine failure leases the prompt again; a prompt vLLM cannot take (here: empty after tokenising) is
    rejected with its reason; neither holds a place in the staleness window, so every valid prompt arrives."""
    cfg = config_from_dict({"trainer": {"batch_size": 4, "group_size": 2, "max_staleness": 1, "total_steps": 100},
                            "hub": {"heartbeat_s": 0.2}})
    rows = echo_rows(32, 0)
    for pid in (3, 7):
        rows[pid] = {**rows[pid], "prompt": ""}  # no ids: the hub rejects it without leasing it
    engine = FlakyEngine(bad_first=4 + int(rows[0]["prompt"][0]))  # the fake tokenizer: digit d -> id 4 + d
    trained = set()
    async with running(cfg, tmp_path, engine, rows) as (hub, gen):
        while len(trained) < 30:  # every valid prompt of the epoch, despite the failures
            batch, *_ = await asyncio.wait_for(asyncio.to_thread(hub.take_batch, 0), 10)
            trained |= {(g.epoch, g.prompt_id) for g in batch}
            hub.finish_step(0)
    assert {pid for e, pid in trained if e == 0} == set(range(32)) - {3, 7}
    assert engine.failed == 1 and hub.counters["requeued"] >= 1
    assert hub.counters["rejected_prompts"] >= 2
    rejected = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
                if '"prompt_rejected"' in line]
    assert {e["prompt_id"] for e in rejected if e["epoch"] == 0} == {3, 7}
    assert all("empty after tokenising" in e["reason"] for e in rejected)


def test_too_many_rejected_prompts_stop_the_run_with_the_reason(tmp_path):
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2}, "hub": {"max_rejected_prompts": 2}})
    hub = Hub(cfg, echo_rows(8, 0), tmp_path, "unit", encode=encode, vocab_size=VOCAB)
    hub.serve_weights(senders(cfg, hub, "unit"))
    with hub.lock:  # a lone generator: its rejections are the run's (no other engine could try)
        gen = hub.registry.generators["g"] = GeneratorInfo("g", "h", "", 1, 0, "zmq", time.monotonic())
        lease = hub._on_lease_request(P.LeaseRequest("g", 4), gen)
        for item in lease.groups[:2]:
            failed = P.GroupFailed("g", lease.lease_id, item.epoch, item.prompt_id, "prompt too long", "prompt")
            hub.control(failed, b"", "")
    with pytest.raises(HubStopped, match="2 prompts were rejected.*prompt too long"):
        hub.take_batch(0)
    hub.stop()  # its sockets and context (left to the garbage collector, a context's term may block a later test)


async def test_a_generator_holding_another_runs_weights_loads_this_runs_before_generating(tmp_path):
    """Reconnecting to a restarted learner (or a new run on the same port) before its first announcement: the
    engine holds version 3 of another run, and the learner is at version 3 too. Nothing may be generated on,
    or labelled with, the foreign weights: the generator waits for this run's version 3 and loads it."""
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 10},
                            "weights": {"transport": "zmq"}, "hub": {"heartbeat_s": 0.2}})
    engine = FakeEngine(version=3, run_id="an-older-run")
    async with running(cfg, tmp_path, engine, version=3, announce=False) as (hub, gen):
        await _until(lambda: gen.id in hub.registry.generators and hub.ledger.leases)  # registered, leases taken
        await asyncio.sleep(1.0)
        assert not hub.ledger.buffer and engine.loaded == []  # nothing generated on the foreign weights
        publish(hub, 3)  # the learner's first publish
        await _until(lambda: len(hub.ledger.buffer) >= 2)
        assert engine.loaded[0] == (3, checksum(_blob(3))) and engine.run_id == "unit"
        assert hub.counters["rejected_rollouts"] == 0


async def test_a_dead_engine_makes_its_generator_leave_at_once_with_the_engines_error(tmp_path):
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 50},
                            "hub": {"heartbeat_s": 30, "heartbeat_timeout_s": 60}})
    engine = FakeEngine()
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: hub.ledger.leases or hub.ledger.buffer)  # it works (leases settle in ms: either is seen)
        engine.is_dead = True  # as when vLLM's engine core process is killed
        code = await asyncio.wait_for(gen.task, 10)  # within seconds, not heartbeat_timeout_s
        assert code == 1 and gen.id not in hub.registry.generators and not hub.ledger.leases
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    leave = next(e for e in events if e["event"] == "leave")
    assert "vLLM engine died" in leave["reason"] and "exit codes [-9]" in leave["reason"]


def failing_reward(prompts, completions, **_):
    return [1.0 / 0 for _ in completions]


async def test_a_reward_function_that_raises_is_an_error_of_the_run_with_its_traceback(tmp_path):
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "total_steps": 50},
                            "rewards": [{"fn": f"{__name__}:failing_reward"}],
                            "hub": {"heartbeat_s": 0.2, "max_reward_errors": 3}})
    async with running(cfg, tmp_path, FakeEngine()) as (hub, gen):
        with pytest.raises(HubStopped, match=r"reward functions raised \d+ times(.|\n)*ZeroDivisionError"):
            await asyncio.wait_for(asyncio.to_thread(hub.take_batch, 0), 10)
        assert await asyncio.wait_for(gen.task, 10) == 1  # told the run failed: it leaves
        assert hub.counters["rejected_prompts"] == 0 and f"{__name__}:failing_reward" in hub.failure


class DyingOnLoad(FakeEngine):
    """Its engine core dies while a new version is being loaded."""

    async def swap(self, version, method, *args):
        if version >= 1:
            self.is_dead = True
            raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        return await super().swap(version, method, *args)


async def test_an_engine_that_dies_while_loading_weights_ends_the_generator_not_a_reconnect_loop(tmp_path):
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 50},
                            "weights": {"transport": "zmq"}, "hub": {"heartbeat_s": 0.2}})
    engine = DyingOnLoad()
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(hub.ledger.buffer) >= 2)
        publish(hub, 1)
        assert await asyncio.wait_for(gen.task, 10) == 1  # not "register again" forever with a dead engine
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("register") == 1
    assert "vLLM engine died" in next(e for e in events if e["event"] == "leave")["reason"]


class RefusingOnLoad(FakeEngine):
    """Its engine refuses version 1's tensors every time (alive: as vLLM's worker raising in collective_rpc)."""

    async def swap(self, version, method, *args):
        if version >= 1:
            raise AttributeError("'WeightsMapper' object has no attribute 'get_rename_mapper'")
        return await super().swap(version, method, *args)


async def test_a_version_that_fails_to_load_every_time_ends_the_generator_with_the_error(tmp_path, monkeypatch):
    """A load that fails registers again and takes the version anew (a broadcast may time out once); one that fails
    MAX_LOAD_FAILURES times in a row ends the generator naming the error, not a reconnect loop (seen on a GPU: 400
    reconnects in four minutes, the run waiting)."""
    from generator import service

    monkeypatch.setattr(service, "MAX_LOAD_FAILURES", 3)
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 50},
                            "weights": {"transport": "zmq"}, "hub": {"heartbeat_s": 0.2},
                            "generator": {"hub_lost_s": 60}})
    engine = RefusingOnLoad()
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(hub.ledger.buffer) >= 2)
        publish(hub, 1)
        assert await asyncio.wait_for(gen.task, 30) == 1
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("register") == 3  # the first, then once after each of 2 failures
    assert engine.version == 0


async def test_a_generator_holding_the_previous_version_fetches_only_the_delta(tmp_path):
    """weights.delta: version 2 differs from version 1 in a few elements; the generator that holds version 1 pulls
    a delta of a few KB instead of the 4 MB blob, and loads exactly version 2's bytes."""
    from weights.files import FileSender

    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 10},
                            "weights": {"transport": "zmq", "chunk_mb": 1, "delta": True}, "hub": {"heartbeat_s": 0.2}})
    engine = FakeEngine()
    weights = torch.arange(1_000_000, dtype=torch.float32)
    async with running(cfg, tmp_path, engine, announce=False) as (hub, gen):
        sender = FileSender(cfg, hub, "unit")
        sender.send(0, [("w", weights)], 0.0)
        await _until(lambda: engine.version == 0 and engine.loaded)
        for version in (1, 2):
            weights = weights.clone()
            weights[version * 1000:version * 1000 + 10] += 1.0  # a step that changed ten elements
            hub.finish_step(version)
            sender.send(version, [("w", weights)], 0.0)
            before = gen.session.receiver.fetched
            await _until(lambda v=version: engine.version == v)
            assert gen.session.receiver.via == "zmq-delta" and sender.sizes[1] < 20_000 < 4_000_000 < sender.sizes[0]
            assert gen.session.receiver.fetched - before == sender.sizes[1]  # the delta, not the blob
            assert engine.loaded[-1] == (version, checksum(serialize([("w", weights)])))


def test_rollouts_go_to_the_host_the_generator_reached_the_hub_by():
    """A hub bound to 0.0.0.0 names its rollouts socket on 127.0.0.1: a generator on another host pushes to the
    address it registered at, with the rollouts port."""
    from generator.service import _on_host_of

    assert _on_host_of("tcp://127.0.0.1:41234", "tcp://10.1.2.3:5555") == "tcp://10.1.2.3:41234"
    assert _on_host_of("tcp://127.0.0.1:41234", "tcp://[fe80::1]:5555") == "tcp://[fe80::1]:41234"


# ---- issue 32: drains, signals, reconnects and a lost hub ------------------------------------------------------


def _events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


class StubbornEngine(FakeEngine):
    """Its requests outlive a cancellation (as a rollout function that cleans up at length when cancelled)."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, prompt_ids, n, sampling, seed=None):
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            await self.release.wait()
            raise
        return await super().generate(prompt_ids, n, sampling, seed)


async def test_a_second_signal_leaves_at_once_whatever_is_still_running(tmp_path):
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 10},
                            "hub": {"heartbeat_s": 0.2}})
    engine = StubbornEngine()
    try:
        async with running(cfg, tmp_path, engine) as (hub, gen):
            await _until(lambda: _groups(gen))
            gen._on_signal()
            gen._on_signal()
            assert await asyncio.wait_for(gen.task, 10) == 0  # not held by groups that do not end when cancelled
            assert gen.id not in hub.registry.generators and not hub.ledger.leases
    finally:
        engine.release.set()
    assert [e["event"] for e in _events(tmp_path) if e.get("generator") == gen.id][-2:] == ["drain", "leave"]


class StuckSetup(Receiver):
    """A weights receiver whose start (nccl: meeting the learner in a process group) never ends."""

    in_order = True

    async def start(self, engine, host, welcome):
        await asyncio.Event().wait()


async def test_a_drain_does_not_wait_for_the_weights_transport_to_start(tmp_path, monkeypatch):
    monkeypatch.setattr("generator.service.receiver", lambda *args: StuckSetup())
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "total_steps": 10},
                            "hub": {"heartbeat_s": 0.2}})
    async with running(cfg, tmp_path, FakeEngine()) as (hub, gen):
        await _until(lambda: gen.id in hub.registry.generators)
        gen._on_signal()
        assert await asyncio.wait_for(gen.task, 10) == 0
        assert gen.id not in hub.registry.generators
    assert "leave" in [e["event"] for e in _events(tmp_path) if e.get("generator") == gen.id]


async def test_a_registration_resets_the_reconnect_back_off(tmp_path, caplog):
    """Separate incidents each start again at 0.5 s (docs/failures.md), instead of doubling on from the last."""
    import logging

    caplog.set_level(logging.WARNING, logger="generator.service")
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "total_steps": 50},
                            "hub": {"heartbeat_s": 0.1}})
    async with running(cfg, tmp_path, FakeEngine()) as (hub, gen):
        for incident in range(3):
            await _until(lambda: gen.id in hub.registry.generators and gen.welcomed)
            with hub.lock:  # as after a heartbeat timeout: told "register again", it reconnects
                hub.membership.drop(gen.id, "heartbeat timeout")
            await _until(lambda n=incident: len([r for r in caplog.records if "reconnecting in" in r.message]) > n)
        await _until(lambda: gen.id in hub.registry.generators)
    delays = [r.message.split("reconnecting in ")[1].split(" s")[0] for r in caplog.records
              if "reconnecting in" in r.message]
    assert delays == ["0.5"] * 3


async def test_a_request_whose_send_never_completes_fails_as_a_lost_hub(monkeypatch, free_port):
    """A send that waits for ever (no connection to send on) is bounded by the request's timeout like its reply."""
    import zmq.asyncio

    from pipeline.client import HubClient

    async def never(self, *args, **kw):
        await asyncio.Event().wait()

    monkeypatch.setattr(zmq.asyncio.Socket, "send", never)
    client = HubClient(f"tcp://127.0.0.1:{free_port}", timeout=0.5)
    try:
        with pytest.raises(P.PeerLost, match="no reply from the hub"):
            await asyncio.wait_for(client.request(P.Heartbeat("g")), 10)
    finally:
        client.close()


@pytest.fixture
def quick_requests(monkeypatch):
    """Every hub request times out within 2 s (a generator waits 10 s at least): the tests that wait for requests to
    time out wait that long, not 10 s each."""
    from pipeline.client import HubClient

    request = HubClient.request

    async def within_2_s(self, msg, timeout=None):
        return await request(self, msg, min(timeout or self.timeout, 2.0))

    monkeypatch.setattr(HubClient, "request", within_2_s)


async def test_a_generator_whose_messages_cannot_be_sent_gives_up_with_the_reason(tmp_path, monkeypatch, caplog,
                                                                                   quick_requests):
    """Its event loop alive but every send stuck (the hang seen twice): the heartbeat's request fails, and with no
    answer from the hub for generator.hub_lost_s it exits 1 saying so, instead of falling silent for good."""
    import zmq.asyncio

    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "total_steps": 50},
                            "generator": {"hub_lost_s": 1.0}, "hub": {"heartbeat_s": 0.2}})
    async with running(cfg, tmp_path, FakeEngine()) as (hub, gen):
        await _until(lambda: len(hub.ledger.buffer) >= 2)

        async def never(self, *args, **kw):
            await asyncio.Event().wait()

        monkeypatch.setattr(zmq.asyncio.Socket, "send", never)
        assert await asyncio.wait_for(gen.task, 30) == 1  # (a request times out after 2 s: quick_requests)
    assert any("no answer from the hub" in r.message and "generator.hub_lost_s" in r.message for r in caplog.records)


async def test_a_generator_reconnecting_when_the_learner_ends_gives_up_with_the_reason(tmp_path, caplog,
                                                                                        quick_requests):
    """The hub dropped it, and the learner finished and exited while it reconnected: it does not retry for ever."""
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "total_steps": 50},
                            "generator": {"hub_lost_s": 1.0}, "hub": {"heartbeat_s": 0.2}})
    async with running(cfg, tmp_path, FakeEngine()) as (hub, gen):
        await _until(lambda: gen.id in hub.registry.generators)
        with hub.lock:
            hub.membership.drop(gen.id, "heartbeat timeout")
        hub.stop()  # the learner is done and gone
        assert await asyncio.wait_for(gen.task, 30) == 1  # (a request times out after 2 s: quick_requests)
    assert any("no answer from the hub" in r.message for r in caplog.records)


async def test_a_group_that_can_no_longer_be_trained_is_stopped_and_leased_again(tmp_path):
    """Groups still generating when the engine loads a version more than k past their samples' start are stopped
    there, not sent to be dropped: their engine requests end, the hub leases their prompts again at once (freeing the
    window's room they held) and counts them as stale, not as faults. A group k versions behind is left to finish."""
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 50},
                            "weights": {"transport": "zmq"}, "hub": {"heartbeat_s": 0.2}})
    engine = FakeEngine()
    engine.hold, engine.cancelled = asyncio.Event(), 0
    fast = engine.generate

    async def generate(*args, **kw):  # held until released: as long completions are
        engine.started.setdefault(asyncio.current_task(), engine.version)
        try:
            await engine.hold.wait()
        except asyncio.CancelledError:
            engine.cancelled += 1
            raise
        return await fast(*args, **kw)

    engine.generate = generate
    async with running(cfg, tmp_path, engine) as (hub, gen):
        await _until(lambda: len(_groups(gen)) == 3)  # the first wave (5/4 of a batch), all started under v0
        publish(hub, 1)
        await _until(lambda: engine.version == 1)
        await asyncio.sleep(0.3)
        assert engine.cancelled == 0 and hub.counters["stale_stopped"] == 0  # v1: within k of v0, trainable
        publish(hub, 2)
        await _until(lambda: hub.counters["stale_stopped"] == 3)
        assert engine.cancelled == 3
        with hub.lock:
            assert not hub.ledger.attempts and hub.counters.get("rejected_prompts", 0) == 0  # no fault of anyone's
        engine.hold.set()
        await _until(lambda: len(hub.ledger.buffer) >= 4)
        with hub.lock:
            assert {b.behaviour for b in hub.ledger.buffer} == {2}  # generated again, under v2
            assert hub.counters["stale_dropped"] == 0
