"""The weight publisher on CPU: each version's blob holds exactly that version's parameters, also after the
next version was published into the other buffer set (the background serialisation reads it meanwhile)."""

import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load

from learner.publisher import WeightPublisher
from weights.files import FileSender


class Hub:  # records what the publisher's file sender announces
    def __init__(self):
        self.blobs, self.last_ready = {}, None

    def announce(self, ready, blob, to=None, delta=None, transports=None):
        self.blobs[ready.version] = blob
        self.last_ready = ready

    def wants_blobs(self, transports):
        return True

    def uses_transport(self, name):
        return False

    def last_file_version(self):
        return self.last_ready


def test_each_version_blob_holds_that_version():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3, bias=False))
    engine = SimpleNamespace(module=module, device=torch.device("cpu"))
    cfg = SimpleNamespace(trainer=SimpleNamespace(zero_stage=0), weights=SimpleNamespace(transport="zmq", delta=False),
                          model=SimpleNamespace(lora=None))
    hub = Hub()
    pub = WeightPublisher(cfg, engine, [FileSender(cfg, hub, "run")], rank=0)
    want = {}
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
        want[version] = {n: p.detach().clone() for n, p in module.named_parameters()}
        pub.publish(version)
    pub.flush()
    assert sorted(hub.blobs) == [1, 2, 3]  # (the training loop, not the publisher, ends a step)
    for version in (1, 2, 3):
        got = load(bytes(hub.blobs[version]))  # safetensors reads bytes; the blob is a bytearray
        assert set(got) == set(want[version])
        for name, t in want[version].items():
            assert torch.equal(got[name], t), (version, name)


class FailingSender:
    """Takes a lock in begin, as the nccl and ipc senders do; its first bucket fails (a broadcast that failed)."""

    device = None

    def __init__(self):
        self.lock = threading.Lock()

    def begin(self, version, plan, published_at):
        self.lock.acquire()
        return True

    def bucket(self, flat):
        raise RuntimeError("broadcast failed")

    def end(self):
        self.lock.release()

    def wanted(self):
        return False


def test_a_version_whose_publishing_fails_still_ends_at_its_senders():
    """A failure between begin and the last bucket must not leave a sender's lock taken: the next version, or a
    joiner's first, would wait on it for good."""
    module = torch.nn.Linear(8, 4)
    cfg = SimpleNamespace(trainer=SimpleNamespace(zero_stage=0), model=SimpleNamespace(lora=None))
    sender = FailingSender()
    pub = WeightPublisher(cfg, SimpleNamespace(module=module, device=torch.device("cpu")), [sender], rank=0)
    with pytest.raises(RuntimeError, match="broadcast failed"):
        pub.publish(1)
    assert sender.lock.acquire(timeout=1)
    pub.flush()


def test_zero3_gather_groups_stay_under_the_limit_in_order():
    from learner.model import _groups

    def param(numel):  # a ZeRO-3 parameter: an empty local tensor, full size in ds_numel
        p = torch.empty(0, dtype=torch.bfloat16)
        p.ds_numel = numel
        return p

    sizes = [10, 20, 30, 100, 5, 5, 40]  # 2 bytes each: a limit of 60 bytes holds 30 elements
    named = [(f"p{i}", param(n)) for i, n in enumerate(sizes)]
    groups = [[name for name, _ in g] for g in _groups(named, 60)]
    assert groups == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5"], ["p6"]]  # p3 alone: larger than the limit
    assert [[name for name, _ in g] for g in _groups(named, 0)] == [[f"p{i}"] for i in range(len(sizes))]


def test_cpu_copies_start_after_the_gathers_unless_the_held_buckets_pass_the_limit():
    """Buckets are held until `seal` (under ZeRO-3 each gather synchronizes the device, which would wait for copies
    already running); past the limit they are copied at once. Either way every buffer ends bit-exact."""
    from learner.publisher import HostCopy
    from weights.plan import unpack

    copy = HostCopy()
    copy.stream = None  # the CPU path (on a GPU the same, on a side stream)
    copy.limit = 80  # bytes
    plan = [["a", "float32", [8]], ["b", "float32", [8]], ["c", "float32", [8]]]
    flats = [torch.arange(32, dtype=torch.uint8) + 32 * i for i in range(3)]  # 32 bytes: one tensor each

    def want(i):
        return flats[i].view(torch.float32)

    buffers = {}
    for i in range(2):
        copy.store(buffers, unpack(flats[i], plan, [i], [0]), flats[i])
    assert buffers == {}  # 64 bytes held: nothing copied while the gathers go on
    assert copy.seal() is None and copy.held == []
    assert torch.equal(buffers["a"], want(0)) and torch.equal(buffers["b"], want(1))

    buffers = {}
    for i in range(3):
        copy.store(buffers, unpack(flats[i], plan, [i], [0]), flats[i])
    assert copy.held == [] and all(torch.equal(buffers[n], want(i)) for i, n in enumerate("abc"))  # 96 > 80



@pytest.mark.parametrize("rank", [0, 1])
def test_save_hf_copies_the_weights_to_host_memory_on_the_writing_rank_only(monkeypatch, tmp_path, rank):
    """Every rank takes part in every gather (collective under ZeRO-3), but only rank 0, which writes, holds the
    full CPU copy: 8 ranks each building it took 8 x 14 GB of host memory for a 7B model."""
    import learner.model as M

    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3, bias=False))
    names = [n for n, _ in module.named_parameters()]
    gathered, copies, saved = [], [], {}

    class Tracked(torch.Tensor):  # counts the copies made of a gathered parameter
        def to(self, *args, **kwargs):
            copies.append(args)
            return super().to(*args, **kwargs)

    def gathers(engine, zero_stage):
        for name, p in engine.module.named_parameters():
            gathered.append(name)
            yield name, p.detach().as_subclass(Tracked)

    monkeypatch.setattr(M, "gathered_weights", gathers)
    module.save_pretrained = lambda out_dir, state_dict: saved.update(state_dict)
    M.save_hf(SimpleNamespace(module=module), SimpleNamespace(trainer=SimpleNamespace(zero_stage=3)), None, tmp_path,
              rank)
    assert gathered == names  # every gather, on every rank
    if rank:
        assert copies == [] and saved == {}
    else:
        assert len(copies) == len(names) and sorted(saved) == sorted(names)
