"""Weight transports on the generator side: files are verified against the announcement."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pipeline import protocol as P
from pipeline.transports import ChecksumMismatch, ShmReceiver, checksum, remove_shm, serialize, write_shm


class FakeZmq:
    name = "zmq"

    def __init__(self):
        self.calls = 0

    async def fetch(self, ready):
        self.calls += 1
        return "via-zmq"


async def test_shm_file_is_verified_and_corruption_refused():
    blob = serialize([("w", torch.arange(1000, dtype=torch.float32))])
    path = write_shm("unit-test", 3, blob)
    try:
        receiver = ShmReceiver(FakeZmq())
        ready = P.WeightsReady(3, len(blob), checksum(blob), path)
        assert await receiver.fetch(ready) == path and receiver.via == "shm"
        assert torch.equal(load_file(path)["w"], torch.arange(1000, dtype=torch.float32))
        with pytest.raises(ChecksumMismatch, match="announced"):
            await receiver.fetch(P.WeightsReady(3, len(blob), checksum(blob) ^ 1, path))
        with open(path, "r+b") as f:  # a flipped byte in the file
            f.seek(len(blob) - 1)
            f.write(b"\x01" if blob[-1:] != b"\x01" else b"\x02")
        with pytest.raises(ChecksumMismatch):
            await receiver.fetch(ready)
    finally:
        remove_shm("unit-test")


async def test_shm_falls_back_to_zmq_for_versions_not_in_shared_memory():
    fallback = FakeZmq()
    receiver = ShmReceiver(fallback)
    assert await receiver.fetch(P.WeightsReady(1, 10, 0, "")) == "via-zmq"
    assert await receiver.fetch(P.WeightsReady(2, 10, 0, "/dev/shm/pipeline-gone/weights-v2.safetensors")) == "via-zmq"
    assert fallback.calls == 2
    assert receiver.via == "zmq"  # what the generator reports in its weights_applied event


def test_old_versions_are_removed_from_shared_memory():
    blob = serialize([("w", torch.zeros(4))])
    try:
        paths = [write_shm("unit-test2", v, blob) for v in range(4)]
        import os

        assert [os.path.exists(p) for p in paths] == [False, False, True, True]  # keeps the newest two
    finally:
        remove_shm("unit-test2")


def test_nccl_buckets_carry_every_tensor_bit_exact(monkeypatch):
    """The learner packs parameters into a few flat broadcasts; the generator's plan, computed from the same
    manifest, unpacks them into the same names, dtypes, shapes and values."""
    import torch

    from learner import collective as C

    monkeypatch.setattr(C, "BUCKET_BYTES", 1000)
    named = [("a", torch.randn(3, 5, dtype=torch.bfloat16)), ("b", torch.arange(7, dtype=torch.int64)),
             ("big", torch.randn(40, 10)), ("c", torch.randn(1, dtype=torch.bfloat16)), ("d", torch.randn(2, 3))]
    plan = C.manifest(named)
    assert plan[0] == ["a", "bfloat16", [3, 5]]
    groups = C.buckets(plan)
    assert [g[0] for g in groups] == [[0, 1, 2], [3, 4]]  # "big" (1600 bytes) closes the first bucket
    assert all(off % C.ALIGN == 0 for _, offs, _ in groups for off in offs)

    sent = []
    packer = C.Packer(plan, "cpu", lambda flat, idx, offs: sent.append(flat.clone()))
    for _, t in named:
        packer.add(t)
    packer.finish()
    assert len(sent) == 2
    got = [x for flat, (idx, offs, _) in zip(sent, groups, strict=True) for x in C.unpack(flat, plan, idx, offs)]
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, t) in zip(named, got, strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    short = C.Packer(plan, "cpu", sent.append)
    short.add(named[0][1])
    with pytest.raises(RuntimeError, match="0 of 2 buckets"):
        short.finish()
