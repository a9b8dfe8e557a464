"""ZeroMQ CURVE between the hub and its peers (real sockets, keys made by `pipeline keys`): only listed keys get
in, a generator id is bound to the key that registered it, operators alone may status and set."""

from __future__ import annotations

import pytest
import zmq

from pipeline import protocol as P
from pipeline.config import ConfigError, config_from_dict
from pipeline.entrypoints.cli import main as cli
from pipeline.security import check_exposure, client_keys, make_keys
from tests.unit.peers import Peer, new_hub, wait_until


@pytest.fixture
def keyed(tmp_path):
    keys = tmp_path / "keys"
    assert cli(["keys", str(keys)]) == 0
    assert cli(["keys", str(keys), "--generator", "gen-b"]) == 0
    hub = new_hub(tmp_path, hub={"host": "0.0.0.0"}, auth={"keys": str(keys)})
    yield hub, keys
    hub.stop()


def _silent(peer: Peer, msg: P.Message) -> bool:
    """No reply: the handshake failed, nothing reached the hub."""
    peer.sock.send(P.encode(msg, 1))
    return not peer.sock.poll(1500)


def test_only_listed_keys_get_in_and_an_id_belongs_to_its_key(keyed, tmp_path):
    hub, keys = keyed
    a = Peer(hub, "gen-a", client_keys(str(keys), "generator"))
    welcome = a.register()
    assert isinstance(welcome, P.Welcome)
    lease = a.lease(1)
    a.send_groups(lease)  # rollouts over CURVE too, from the key that registered
    wait_until(lambda: len(hub.ledger.buffer) == 1)
    # no keys at all, and a key pair the hub does not list: not a single message gets through
    assert _silent(Peer(hub, "gen-a"), P.Heartbeat("gen-a"))
    make_keys(tmp_path / "other", ["stranger"], [])
    own = client_keys(str(tmp_path / "other"), "stranger")
    own.server = client_keys(str(keys), "generator").server  # it knows the hub's public key, which is no secret
    stranger = Peer(hub, "gen-a", own)
    assert _silent(stranger, P.Register("gen-x"))
    assert hub.auth.refused >= 1 and hub.counters["unlisted_keys"] >= 1  # counted (pipeline status, metrics.jsonl)
    # another listed generator key cannot speak for gen-a, over control or rollouts, even knowing its session
    b = Peer(hub, "gen-a", client_keys(str(keys), "gen-b"))
    b.session = welcome.session
    assert "did not register it" in b.ask(P.Heartbeat("gen-a", 7, draining=True)).message
    assert "another connection" in b.register().message
    second = a.lease(1)
    b.send(a.group(second, second.groups[0]))  # gen-a's rollout, session and all, from gen-b's key
    wait_until(lambda: hub.counters.get("rejected/identity", 0) == 1)
    assert len(hub.ledger.buffer) == 1 and second.lease_id in hub.ledger.leases
    assert hub.registry.generators["gen-a"].version == -1 and not hub.registry.generators["gen-a"].draining
    # a generator key may not steer the run; an operator key may
    assert "operator key" in a.ask(P.SetRequest("trainer.lr", 1.0)).message
    assert "operator key" in a.ask(P.StatusRequest()).message
    operator = Peer(hub, "op", client_keys(str(keys), "operator"))
    assert isinstance(operator.ask(P.SetRequest("trainer.lr", 1e-3)), P.SetReply) and hub.cfg.trainer.lr == 1e-3
    assert operator.ask(P.StatusRequest()).authenticated is True
    assert "generator key" in operator.ask(P.Register("op")).message  # and an operator is not a generator
    for p in (a, stranger, b, operator):
        p.close()


def test_a_key_added_while_the_run_goes_on_admits_a_new_generator(keyed):
    hub, keys = keyed
    make_keys(keys, ["late"], [])
    late = Peer(hub, "late", client_keys(str(keys), "late"))
    assert isinstance(late.register(), P.Welcome)
    late.close()


def test_status_and_set_from_the_command_line_need_the_operator_key(keyed, capsys):
    hub, keys = keyed
    address = hub.address
    assert cli(["set", "--learner", address, "--keys", str(keys), "trainer.max_staleness=3"]) == 0
    assert hub.cfg.trainer.max_staleness == 3
    assert cli(["set", "--learner", address, "--keys", str(keys), "--identity", "generator",
                "trainer.max_staleness=4"]) == 2
    assert "needs an operator key" in capsys.readouterr().err and hub.cfg.trainer.max_staleness == 3
    assert cli(["status", "--learner", address, "--keys", str(keys)]) == 0
    assert "version 0" in capsys.readouterr().out


def test_the_hub_binds_another_interface_only_with_keys_or_when_told(tmp_path):
    with pytest.raises(ConfigError, match="hub.host: 0.0.0.0 would let anyone"):
        check_exposure(config_from_dict({"hub": {"host": "0.0.0.0"}}))
    check_exposure(config_from_dict({"hub": {"host": "0.0.0.0", "allow_insecure": True}}))
    check_exposure(config_from_dict({"hub": {"host": "0.0.0.0"}, "auth": {"keys": str(tmp_path)}}))
    check_exposure(config_from_dict({}))  # loopback
    assert cli(["learner", "-c", "configs/demo.yaml", "--set", "hub.host=0.0.0.0"]) == 2


def test_secret_keys_are_private_and_key_errors_name_the_field(tmp_path):
    written = make_keys(tmp_path / "k")
    secrets = [p for p in written if p.name.endswith(".key_secret")]
    assert secrets and all(p.stat().st_mode & 0o077 == 0 for p in secrets)
    with pytest.raises(ConfigError, match="auth.identity: cannot read key"):
        client_keys(str(tmp_path / "k"), "nobody")
    assert zmq.has("curve")


def test_one_key_under_several_ids_is_one_voice(keyed):
    """Faults that end a run need two principals: with keys, a principal is a key, so a compromised host
    registering two ids cannot confirm its own prompt rejections while another key's generator runs."""
    hub, keys = keyed
    hub.cfg.trainer.batch_size = 8  # room in the window for everyone's leases
    honest = Peer(hub, "honest", client_keys(str(keys), "generator"))
    sybils = [Peer(hub, f"sybil-{i}", client_keys(str(keys), "gen-b")) for i in range(2)]
    for p in (honest, *sybils):
        assert isinstance(p.register(), P.Welcome)
    lease = sybils[0].lease(1)
    item = lease.groups[0]
    sybils[0].ask(P.GroupFailed("sybil-0", lease.lease_id, item.epoch, item.prompt_id, "too long", "prompt"))
    again = sybils[1].lease(8)
    assert (item.epoch, item.prompt_id) not in {(g.epoch, g.prompt_id) for g in again.groups}  # same key: skipped
    assert hub.counters["rejected_prompts"] == 0
    taken = honest.lease(8)
    assert (item.epoch, item.prompt_id) in {(g.epoch, g.prompt_id) for g in taken.groups}
    for p in (honest, *sybils):
        p.close()


def test_one_key_cannot_take_every_generator_slot(tmp_path):
    """hub.max_generators_per_key: a key (one principal) registers that many generators at most, so one compromised
    host cannot fill hub.max_generators; another key still registers, and a reconnect under a live id is no new one."""
    keys = tmp_path / "keys"
    assert cli(["keys", str(keys)]) == 0
    assert cli(["keys", str(keys), "--generator", "gen-b"]) == 0
    hub = new_hub(tmp_path, hub={"host": "0.0.0.0", "max_generators_per_key": 2, "max_generators": 8},
                  auth={"keys": str(keys)})
    try:
        sybils = [Peer(hub, f"sybil-{i}", client_keys(str(keys), "gen-b")) for i in range(3)]
        assert all(isinstance(p.register(), P.Welcome) for p in sybils[:2])
        refused = sybils[2].register()
        assert isinstance(refused, P.Error) and refused.stop and "hub.max_generators_per_key" in refused.message
        assert isinstance(sybils[0].register(), P.Welcome)  # the same id again, with its session
        honest = Peer(hub, "honest", client_keys(str(keys), "generator"))
        assert isinstance(honest.register(), P.Welcome)
        assert set(hub.registry.generators) == {"sybil-0", "sybil-1", "honest"}
        for p in (*sybils, honest):
            p.close()
    finally:
        hub.stop()
