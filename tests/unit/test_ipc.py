"""The ipc transport's learner side (weights/ipc.py) without a GPU: CUDA's IPC export and the device's uuid are
stubbed, the buffers are CPU tensors. Each version is written into the shared buffers only once every generator
of the transport applied the one before, one that never does is dropped, and the announcement carries handles
whose forgeries are refused before a worker opens them."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import msgpack
import pytest
import torch

from pipeline import protocol as P
from weights import ipc
from weights.plan import Packer, buckets, manifest, unpack_all


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed": torch.randn(40, 8, generator=g).to(torch.bfloat16), "norm": torch.randn(8, generator=g)}


class Hub:
    def __init__(self):
        self.announced: list[tuple[P.WeightsReady, list[str]]] = []
        self.dropped: list[tuple[str, str]] = []

    def drop(self, generator_id, reason):
        self.dropped.append((generator_id, reason))

    def announce(self, ready, blob, to=None):
        self.announced.append((ready, list(to)))


@pytest.fixture
def sender(monkeypatch):
    monkeypatch.setattr(ipc, "export", lambda t: P.IpcBuffer(b"h" * 64, t.numel(), 0, b"/torch_1_2", 0, b"e", False))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-learner"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(synchronize=lambda: None))
    cfg = SimpleNamespace(weights=SimpleNamespace(collective_timeout_s=5.0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    s = ipc.IpcSender(cfg, Hub(), "run")
    s.device = torch.device("cpu")
    return s


def _register(gen_id: str) -> P.Register:
    return P.Register(gen_id, "h", "boot", "0")


def _publish(sender, version: int) -> dict[str, torch.Tensor]:
    w = _weights(version)
    plan = manifest(w.items())
    assert sender.begin(version, plan, 0.0)
    Packer(plan, "cpu", lambda flat, idx, offs: sender.bucket(flat)).pack(w.values())
    sender.end()
    return w


def _held(sender) -> dict[str, torch.Tensor]:
    return dict(unpack_all(sender.buffers, sender.plan, buckets(sender.plan)))


def test_a_version_is_written_only_once_every_generator_applied_the_one_before(sender) -> None:
    assert not sender.begin(1, manifest(_weights(1).items()), 0.0)  # no generator of this transport: nothing kept
    sender.join(_register("a"), b"", 0)
    sender.join(_register("b"), b"", 0)
    sent = _publish(sender, 1)
    ready, to = sender.announcer.announced[-1]
    assert (ready.version, sorted(to)) == (1, ["a", "b"])
    assert ready.ipc.uuid == "GPU-learner" and len(ready.ipc.buffers) == len(buckets(ready.manifest))
    for name, t in _held(sender).items():
        assert torch.equal(t, sent[name]), name

    sender.on_applied("a", 1)
    writing = threading.Thread(target=_publish, args=(sender, 2))
    writing.start()
    writing.join(0.5)
    assert writing.is_alive()  # b still reads v1 from the buffers: v2 waits
    assert torch.equal(_held(sender)["norm"], sent["norm"])
    sender.on_applied("b", 1)
    writing.join(5)
    assert not writing.is_alive() and sender.announcer.announced[-1][0].version == 2
    assert torch.equal(_held(sender)["norm"], _weights(2)["norm"])


def test_a_generator_that_does_not_apply_within_the_timeout_is_dropped(sender) -> None:
    sender.join(_register("a"), b"", 0)
    sender.join(_register("b"), b"", 0)
    _publish(sender, 1)
    sender.on_applied("a", 1)
    sender.timeout_s = 0.2
    _publish(sender, 2)  # b never applied v1: dropped, a gets v2
    assert sender.announcer.announced[-1][1] == ["a"]
    assert "b" in sender.failed and "a" not in sender.failed
    # it registers again
    assert sender.announcer.dropped == [("b", "ipc transport: did not apply weights v1 within 0 s")]
    sender.leave("a", again=True)  # it applied versions: it may have ipc again
    sender.join(_register("c"), b"", 0)
    sender.leave("c", again=True)  # re-registers before applying anything (its workers could not open them)
    assert "a" not in sender.failed and "c" in sender.failed


def _ready(**ipc_fields) -> bytes:
    w = _weights(1)
    plan = manifest(w.items())
    buffers = [P.IpcBuffer(b"h" * 64, size, 0, b"/torch_1_2", 0, b"e", False) for *_, size in buckets(plan)]
    msg = P.WeightsReady(1, manifest=plan, ipc=P.IpcHandles("GPU-learner", buffers))
    body = msgpack.unpackb(P.encode(msg), raw=False)
    for key, value in ipc_fields.items():
        body["ipc"]["buffers"][0][key] = value
    return msgpack.packb(body)


def test_forged_handles_are_refused_before_a_worker_opens_them(monkeypatch) -> None:
    ready, _ = P.decode(_ready())
    ipc.check_handles(ready.ipc, ready.manifest)  # the genuine one passes
    with pytest.raises(P.ProtocolError, match=r"ipc\.buffers\[0\]\.handle: expected bytes, got str"):
        P.decode(_ready(handle="not bytes"))
    small, _ = P.decode(_ready(size=16))
    with pytest.raises(P.ProtocolError, match=r"ipc.buffers\[0\]: 16 bytes at offset 0 for a bucket of"):
        ipc.check_handles(small.ipc, small.manifest)
    short = P.WeightsReady(1, manifest=ready.manifest, ipc=P.IpcHandles("GPU-learner", []))
    with pytest.raises(P.ProtocolError, match="0 buffers for 1 buckets"):
        ipc.check_handles(short.ipc, short.manifest)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-other"))
    with pytest.raises(RuntimeError, match="buffers are on GPU GPU-learner, this worker runs on GPU-other"):
        ipc.open_buffers(ready.ipc, ready.manifest, "cuda")


def test_ipc_asked_for_on_a_learner_without_cuda_is_refused_with_the_reason() -> None:
    from weights import senders

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from pipeline.config import config_from_dict

    cfg = config_from_dict({"weights": {"transport": "ipc"}})
    with pytest.raises(ValueError, match="weights.transport ipc: the learner has no CUDA device"):
        senders(cfg, Hub(), "run")
    cfg.weights.transport = "auto"
    assert "ipc" not in senders(cfg, Hub(), "run")


def test_a_broadcast_receiver_leaves_ipc_announcements_alone() -> None:
    from weights.nccl import NcclReceiver

    ready, _ = P.decode(_ready())
    assert ipc.IpcReceiver().accepts(ready) and not NcclReceiver().accepts(ready)
    plain = P.WeightsReady(1, manifest=ready.manifest)
    assert NcclReceiver().accepts(plain) and not ipc.IpcReceiver().accepts(plain)


def test_cudas_files_made_by_the_export_are_removed_at_the_end_and_no_other(sender, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(ipc, "SHM", tmp_path)
    (tmp_path / "cuda.shm.0.99.1").write_bytes(b"")  # another process's

    def export(t):
        (tmp_path / "cuda.shm.0.2b3.1").write_bytes(b"")  # what CUDA makes for the IPC event
        return P.IpcBuffer(b"h" * 64, t.numel(), 0, b"/torch_1_2", 0, b"e", False)

    monkeypatch.setattr(ipc, "export", export)
    sender.join(_register("a"), b"", 0)
    _publish(sender, 1)
    sender.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda.shm.0.99.1"]
