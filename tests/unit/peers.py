"""A hub in process and generator-shaped peers over real ZeroMQ sockets (no engines), for the hub's tests."""

from __future__ import annotations

import time

import zmq

from hub.hub import Hub
from pipeline import protocol as P
from pipeline.config import config_from_dict
from pipeline.security import ClientKeys, secure_client
from pipeline.tasks import echo_rows
from weights import senders

VOCAB = 16  # the tiny model's


def encode(text: str) -> list[int]:
    """The tiny tokenizer's ids for echo prompts: digit d -> 4 + d, '=' -> 3."""
    return [3 if w == "=" else 4 + int(w) for w in text.split() if w == "=" or w.isdigit()]


def new_hub(run_dir, rows=None, version: int = 0, state=None, eval_rows=None, **sections) -> Hub:
    # k = 1: the admission these tests count leases against, whatever the trainer's default
    data = {"trainer": {"batch_size": 2, "group_size": 2, "total_steps": 10, "max_staleness": 1},
            "generator": {"lease_size": 8},
            "hub": {"max_message_mb": 1}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    hub = Hub(config_from_dict(data), rows or echo_rows(16, 0), run_dir, "test", version, state, encode=encode,
              vocab_size=VOCAB, eval_rows=eval_rows)
    hub.serve_weights(senders(hub.cfg, hub, "test"))  # as the learner does
    hub.start()
    return hub


def publish(hub: Hub, version: int) -> None:
    """As the learner after a step: the step that made `version` is done, and the version is announced."""
    hub.finish_step(version)
    hub.announce(P.WeightsReady(version, file=P.FileVersion(0, 0)), None)


class Peer:
    """A generator-shaped client: a DEALER on control and a PUSH on rollouts."""

    def __init__(self, hub: Hub | str, gen_id: str = "gen-t", keys: ClientKeys | None = None):
        """`hub`: an in-process Hub, or the address of a learner's (rollouts then go where its Welcome says)."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, keys)
        self.sock.connect(hub if isinstance(hub, str) else hub.address)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        secure_client(self.push, keys)
        self.pushing = not isinstance(hub, str)
        if self.pushing:
            self.push.connect(f"tcp://127.0.0.1:{hub.server.rollouts_port}")
        self.id = gen_id
        self.session = ""
        self.rid = 0
        self.pushed: list[P.Message] = []

    def raw(self, data: bytes, timeout: float = 5.0) -> P.Message:
        """The hub's reply; what it pushes meanwhile (weight announcements: request id 0) goes to `pushed`."""
        self.sock.send(data)
        while True:
            assert self.sock.poll(int(timeout * 1000)), "the hub did not answer"
            msg, rid = P.decode(self.sock.recv(), limits=P.FROM_HUB)
            if rid or isinstance(msg, P.Error):
                return msg
            self.pushed.append(msg)

    def ask(self, msg: P.Message, timeout: float = 5.0) -> P.Message:
        self.rid += 1
        return self.raw(P.encode(msg, self.rid), timeout)

    def register(self, **fields) -> P.Welcome:
        """Register, showing the run's spec digest, model fingerprints and content digests as a generator that adopted
        them does (pipeline/runspec.py, pipeline/pinning.py)."""
        if "spec_digest" not in fields:
            spec = self.ask(P.SpecRequest(self.id))
            if isinstance(spec, P.RunSpec):
                fields.setdefault("spec_digest", spec.digest)
                fields.setdefault("fingerprints", spec.fingerprints)
                fields.setdefault("contents", spec.contents)
        welcome = self.ask(P.Register(self.id, session=self.session, **fields))
        if isinstance(welcome, P.Welcome):
            self.session = welcome.session
            if not self.pushing:
                self.push.connect(welcome.rollouts_endpoint)
                self.pushing = True
        return welcome

    def lease(self, n: int) -> P.Message:
        return self.ask(P.LeaseRequest(self.id, n))

    def group(self, lease: P.Lease, item: P.PromptItem, version: int = 0, group_size: int = 2,
              tokens=(4, 5), logprobs=(-1.0, -1.0), **fields) -> P.RolloutGroup:
        """A valid group for `item` of `lease`; `fields` replace the group's, `sample` fields its samples'."""
        sample = fields.pop("sample", {})
        samples = [P.Sample(**{**dict(token_ids=P.pack_ints(tokens), logprobs=P.pack_floats(logprobs),
                                      reward=float(i), rewards=[float(i)], finish_reason="stop", first_version=version,
                                      last_version=version), **sample}) for i in range(group_size)]
        body = dict(lease_id=lease.lease_id, generator_id=self.id, prompt_id=item.prompt_id, epoch=item.epoch,
                    prompt_ids=item.prompt_ids, samples=samples, temperature=lease.sampling.temperature,
                    session=self.session)
        return P.RolloutGroup(**{**body, **fields})

    def send(self, group: P.RolloutGroup) -> None:
        self.push.send(P.encode(group))

    def send_groups(self, lease: P.Lease, version: int = 0, group_size: int = 2) -> None:
        for item in lease.groups:
            self.send(self.group(lease, item, version, group_size))

    def close(self):
        self.sock.close(0)
        self.push.close(0)
        self.ctx.term()


def wait_until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
