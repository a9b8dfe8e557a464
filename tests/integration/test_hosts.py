"""Generators on other hosts, for real: the learner and every generator in a Linux network namespace of its own, on one
switch (bench/netns.py), so that each address is a non-loopback interface and nothing is shared but the file system.

Two runs, both with CURVE keys and the hub on 0.0.0.0. Over `auto`: a generator on host b joins, trains and leaves,
over zmq (another host: never shm); a stranger on host c gets nothing through, and its refusals are counted. Over the
collective transport (gloo on CPU): b and d receive every version by broadcast, d's link is cut (`ip link set ...
down`: no FIN, no RST) while it holds leases; d is dropped after hub.heartbeat_timeout_s, the learner does not wait
for it longer, and its leased prompts are trained by b, every prompt once. Where namespaces cannot be made (not root,
no iproute2) these tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.netns import Hosts, remove_stale
from pipeline.metrics import read_jsonl
from pipeline.security import make_keys
from tests.conftest import REPO, wait_for
from tests.integration.helpers import events, held_at, start_generator, start_learner

pytestmark = pytest.mark.integration


@pytest.fixture
def hosts():
    """Hosts on one switch (bench/netns.py). Request it before `procs`: the services stop before their hosts go."""
    remove_stale("pipeline-test-")  # of sessions killed before their teardown
    made = Hosts(f"pipeline-test-{os.getpid()}")
    try:
        made.open()
    except OSError as e:  # not root, no iproute2, no bridges
        made.remove()
        pytest.skip(f"cannot make network namespaces and a bridge (root and iproute2 needed): {e}")
    try:
        yield made
    finally:
        made.remove()


def _on(hosts: Hosts, host: str, procs):
    """The `procs` fixture's start, starting services on `host`."""
    return lambda args, log, env=None: procs(args, log, env, prefix=hosts.prefix(host))


def _keys(tmp_path: Path, names: list[str]) -> tuple[Path, dict[str, Path]]:
    """The learner's keys folder, and for each generator host a folder of its own holding what is copied there: the
    hub's public key and its own secret key."""
    keys = tmp_path / "keys"
    make_keys(keys, names, ["operator"])
    own = {}
    for name in names:
        own[name] = tmp_path / f"keys-{name}"
        own[name].mkdir(mode=0o700)
        for f in ("hub.key", f"{name}.key_secret"):
            shutil.copy(keys / f, own[name] / f)
    return keys, own


def _id_of(run_dir: Path, proc) -> str:
    return next(e["generator"] for e in events(run_dir, "register") if f"-{proc.pid}-" in e["generator"])


# a stranger: no keys, then a key pair of its own (it knows the hub's public key, which is no secret)
STRANGER = """
import sys
from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.security import client_keys
for keys in (None, client_keys(sys.argv[2], "stranger")):
    for msg in (P.Register("stranger"), P.StatusRequest()):
        try:
            print(type(request_once(sys.argv[1], msg, timeout=3.0, keys=keys)).__name__)
        except P.PeerLost:
            print("no reply")
"""

# stop a generator (SIGSTOP to its process group) at a moment it holds a lease, as the operator sees it: its host then
# vanishes with prompts leased to it
FREEZE = """
import os, signal, sys, time
from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.security import client_keys
address, keys, gen_id, group = sys.argv[1], client_keys(sys.argv[2], "operator"), sys.argv[3], int(sys.argv[4])
while True:
    os.killpg(group, signal.SIGSTOP)
    if sum(g.leases for g in request_once(address, P.StatusRequest(), keys=keys).generators if g.id == gen_id):
        break
    os.killpg(group, signal.SIGCONT)
    time.sleep(0.2)
"""


def _python(hosts: Hosts, host: str, code: str, *args: str, timeout: float = 60) -> str:
    out = subprocess.run([*hosts.prefix(host), sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_generator_on_another_host_trains_over_zmq_and_a_stranger_gets_nothing(hosts, procs, tmp_path,
                                                                                   model_cache, free_port):
    """b, with its own key, trains the run over zmq; c tries without a key and with an unlisted one."""
    learner_at, _ = hosts.add("a"), hosts.add("b")
    hosts.add("c")
    run_dir, steps = tmp_path / "zmq", 6
    keys, own = _keys(tmp_path, ["host-b"])
    stranger = tmp_path / "keys-stranger"
    make_keys(stranger, ["stranger"], [])
    shutil.copy(keys / "hub.key", stranger / "hub.key")
    common = [f"trainer.total_steps={steps}", "trainer.batch_size=8"]
    # the learner holds before its last step until the stranger is done: the last record counts all its knocks (the
    # run could end before its 12 s of knocking: the last record then counted one of the two keyed handshakes)
    release = tmp_path / "stranger-done"
    learner = start_learner(_on(hosts, "a", procs), run_dir, free_port,
                            [*common, "hub.host=0.0.0.0", f"auth.keys={keys}"], env=held_at(steps - 1, release))
    gen = start_generator(_on(hosts, "b", procs), run_dir, free_port,
                          [*common, f"auth.keys={own['host-b']}", "auth.identity=host-b"], "b", host=learner_at)
    wait_for(lambda: (run_dir / "hub.json").exists(), 300, "the hub to start", [learner])
    tried = _python(hosts, "c", STRANGER, f"tcp://{learner_at}:{free_port}", str(stranger)).splitlines()
    assert tried == ["no reply"] * 4, tried
    release.touch()
    assert learner.wait(300) == 0, learner.tail()
    assert gen.wait(60) == 0, gen.tail()

    (register,) = events(run_dir, "register")  # b's; the stranger's Register never reached the hub
    assert register["generator"] == _id_of(run_dir, gen) and register["transport"] == "zmq"  # another host: not shm
    applied = [(e["version"], e["via"]) for e in events(run_dir, "weights_applied")]
    assert {via for _, via in applied} == {"zmq"} and applied[-1][0] == steps
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    assert {t[3] for r in records for t in r["trained"]} == {register["generator"]}
    last = records[-1]
    assert last["hub/unlisted_keys"] >= 2  # the stranger's key, refused at each handshake (keyless: not even that far)
    assert last["hub/refused"] == 0 and last["hub/bad_messages"] == 0  # nothing of it reached the hub's handlers


def test_the_collective_transport_reaches_another_host_and_a_cut_link_drops_only_that_generator(
        hosts, procs, tmp_path, model_cache, free_port):
    """d receives every version by broadcast (gloo) until its link is cut while it holds a lease. The hub drops it
    after hub.heartbeat_timeout_s, the broadcast under way to it ends then (it waited weights.collective_timeout_s
    before), and its leased prompts are trained by b, started then, which receives every later version by broadcast:
    every prompt of the epoch is trained exactly once."""
    learner_at, _, _ = hosts.add("a"), hosts.add("b"), hosts.add("d")
    # d's rewards wait while the gate file exists: once it is made, d holds its leases and the run stops (with 24
    # steps and no gate, d once trained 11 of 12 before the freezer, a Python process of its own, had it stopped)
    run_dir, steps, batch, heartbeat_timeout, gate = tmp_path / "nccl", 10, 8, 3, tmp_path / "reward-gate"
    keys, own = _keys(tmp_path, ["host-b", "host-d"])
    common = [f"trainer.total_steps={steps}", "trainer.epochs=1", f"data.size={steps * batch}",
              f"trainer.batch_size={batch}", "weights.transport=nccl", "weights.collective_timeout_s=60",
              "hub.heartbeat_s=0.5", f"hub.heartbeat_timeout_s={heartbeat_timeout}",
              "rewards=[{fn: 'tests.integration.slow_rewards:gated_echo'}]"]
    learner = start_learner(_on(hosts, "a", procs), run_dir, free_port,
                            [*common, "hub.host=0.0.0.0", f"auth.keys={keys}"])

    def generator(h: str):
        return start_generator(_on(hosts, h, procs), run_dir, free_port,
                               [*common, f"auth.keys={own['host-' + h]}", f"auth.identity=host-{h}"], h,
                               host=learner_at, env={"REWARD_GATE": str(gate)})

    # d alone until its link is cut, b only then: the run cannot end before the cut (started together, d could join
    # when b had nearly ended the run; with b started once d was in, CI twice saw the run end while the cut's status
    # request was under way)
    gens = {"d": generator("d")}
    wait_for(lambda: events(run_dir, "register"), 300, "d to register", [learner, gens["d"]])
    id_d = _id_of(run_dir, gens["d"])
    wait_for(lambda: [t for r in read_jsonl(run_dir / "metrics.jsonl") for t in r["trained"] if t[3] == id_d], 300,
             "d to contribute", [learner, gens["d"]])
    gate.touch()  # d's next groups wait in scoring, their leases held
    _python(hosts, "a", FREEZE, f"tcp://127.0.0.1:{free_port}", str(keys), id_d, str(gens["d"].pid))
    hosts.cut("d")  # while it holds a lease; then it runs on, unheard
    os.killpg(gens["d"].pid, signal.SIGCONT)
    gate.unlink()  # (d is unheard now; b scores at once)
    cut_at = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert cut_at < steps - 2, "the run was nearly over before the cut: raise the steps"
    gens["b"] = generator("b")
    requeue = wait_for(lambda: [e for e in events(run_dir, "requeue") if e["generator"] == id_d], 60,
                       "d to be dropped", [learner, gens["b"]])[0]
    assert requeue["reason"] == "heartbeat timeout" and requeue["prompts"] > 0
    assert learner.wait(300) == 0, learner.tail()
    assert gens["b"].wait(60) == 0, gens["b"].tail()
    gens["d"].stop(grace=0)  # its host is gone: nothing to drain

    registers = events(run_dir, "register")
    id_b = _id_of(run_dir, gens["b"])
    assert [e["transport"] for e in registers] == ["nccl", "nccl"]
    applied = [(e["version"], e["via"]) for e in events(run_dir, "weights_applied") if e["generator"] == id_b]
    versions = [v for v, _ in applied]  # in order, by broadcast (one that joined late may skip one as it joins)
    assert {via for _, via in applied} == {"nccl"} and versions == sorted(set(versions)) and versions[-1] == steps
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    trained = [(t[0], t[1]) for r in records for t in r["trained"]]
    assert sorted(trained) == [(0, p) for p in range(steps * batch)]  # d's re-queued prompts too, each once
    # the learner waited for d until it was dropped, not weights.collective_timeout_s (60 s): neither in the
    # broadcast under way nor when it let go of d's process group
    assert max(r["sync/weights_ms"] for r in records) < (heartbeat_timeout + 5) * 1000
