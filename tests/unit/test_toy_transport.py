"""Adding a weight transport is one file and one line (issue 43): the toy of tests/unit/toy_transport.py, registered
in pipeline/transports.py, is accepted by the config, built with the learner's senders, picked at registration, and
its versions reach the weights through the vLLM worker extension (generator.worker_ext.WeightLoader, composed with its
mixin)."""

from __future__ import annotations

import importlib

import pytest
import torch

from pipeline.config import ConfigError, config_from_dict
from pipeline.transports import TRANSPORTS
from tests.unit import toy_transport
from tests.unit.test_generator_loop import FakeEngine, _until, running

LINE = ("tests.unit.toy_transport:ShelfSender", "tests.unit.toy_transport:ShelfReceiver",
        "tests.unit.toy_transport:ShelfWorker")


@pytest.fixture
def registered(monkeypatch):
    """The toy's line in the registry, and the worker extension vLLM's workers would import with it."""
    import generator.worker_ext

    monkeypatch.setitem(TRANSPORTS, "toy", LINE)
    yield importlib.reload(generator.worker_ext).WeightLoader
    monkeypatch.undo()
    importlib.reload(generator.worker_ext)
    toy_transport.SHELF.clear()


class WorkerEngine(FakeEngine):
    """A FakeEngine whose swap calls the method by name on a worker extension, as vLLM's collective_rpc does."""

    def __init__(self, loader):
        super().__init__()

        class Worker(loader):  # the extension without vLLM: loading records the tensors
            def __init__(self):
                self.loaded = []

            def _load_named(self, named):
                self.loaded.append({name: t.clone() for name, t in named})

        self.worker = Worker()

    async def swap(self, version, method, *args):
        ms, _ = getattr(self.worker, method)(*args)
        self.version = version
        return ms


def _named(version: int) -> list:
    return [("w", torch.full((4,), float(version))), ("b", torch.arange(3.0) + version)]


async def test_a_toy_transport_is_one_file_and_one_line(tmp_path, registered):
    assert hasattr(registered, "load_from_shelf") and hasattr(registered, "load_weights_blob")  # composed
    cfg = config_from_dict({"trainer": {"batch_size": 2, "group_size": 2, "max_staleness": 1, "total_steps": 10},
                            "weights": {"transport": "toy"}, "hub": {"heartbeat_s": 0.2}})
    engine = WorkerEngine(registered)
    toy_transport.SHELF[0] = _named(0)  # the learner's version 0, there before any generator
    async with running(cfg, tmp_path, engine, announce=False) as (hub, gen):
        await _until(lambda: engine.run_id == "unit")  # v0 came right after the Welcome, by the toy
        assert hub.registry.generators[gen.id].transport == "toy" and gen.session.receiver.via == "toy"
        await _until(lambda: len(hub.ledger.buffer) >= 2)
        hub.finish_step(1)
        sender = hub.weights.senders["toy"]
        assert sender.wanted()
        sender.send(1, _named(1), 0.0)  # as the publisher calls it
        await _until(lambda: engine.version == 1)
    assert [[t.tolist() for t in d.values()] for d in engine.worker.loaded] == \
        [[t.tolist() for _, t in _named(v)] for v in (0, 1)]
    applied = [e for e in (tmp_path / "events.jsonl").read_text().splitlines() if '"weights_applied"' in e]
    assert applied and all('"toy"' in e for e in applied)


def test_a_transport_without_its_line_is_refused_at_load_with_the_names_there_are():
    with pytest.raises(ConfigError, match="weights.transport: 'toy' is not one of 'auto', 'zmq', 'shm', 'nccl', 'ipc'"):
        config_from_dict({"weights": {"transport": "toy"}})
