"""Weight transports on the generator side: files are verified against the announcement."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pipeline import protocol as P
from pipeline.transports import ChecksumMismatch, ShmReceiver, checksum, remove_shm, serialize, write_shm


class FakeZmq:
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
        assert await receiver.fetch(ready) == path
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


def test_old_versions_are_removed_from_shared_memory():
    blob = serialize([("w", torch.zeros(4))])
    try:
        paths = [write_shm("unit-test2", v, blob) for v in range(4)]
        import os

        assert [os.path.exists(p) for p in paths] == [False, False, True, True]  # keeps the newest two
    finally:
        remove_shm("unit-test2")
