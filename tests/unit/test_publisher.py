"""The weight publisher on CPU: each version's blob holds exactly that version's parameters, also after the
next version was published into the other buffer set (the background serialisation reads it meanwhile)."""

from types import SimpleNamespace

import torch
from safetensors.torch import load

from learner.publisher import WeightPublisher


class Hub:  # records what the publisher announces
    def __init__(self):
        self.blobs, self.finished, self.last_ready, self.on_file_join = {}, [], None, None

    def announce(self, ready, blob, to=None):
        self.blobs[ready.version] = blob
        self.last_ready = ready

    def finish_step(self, version):
        self.finished.append(version)

    def wants_blobs(self):
        return True

    def uses_transport(self, name):
        return False


def test_each_version_blob_holds_that_version():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3, bias=False))
    engine = SimpleNamespace(module=module, device=torch.device("cpu"))
    cfg = SimpleNamespace(trainer=SimpleNamespace(zero_stage=0), weights=SimpleNamespace(transport="zmq"))
    hub = Hub()
    pub = WeightPublisher(cfg, engine, hub, "run", rank=0)
    want = {}
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
        want[version] = {n: p.detach().clone() for n, p in module.named_parameters()}
        pub.publish(version)
    pub.flush()
    assert hub.finished == [1, 2, 3]
    for version in (1, 2, 3):
        got = load(hub.blobs[version])
        assert set(got) == set(want[version])
        for name, t in want[version].items():
            assert torch.equal(got[name], t), (version, name)
