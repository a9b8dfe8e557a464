import msgpack
import pytest

from pipeline import protocol as P


def _group(n=2, lease_id=1):
    samples = [P.Sample(P.pack_ints([5, 6, 1]), P.pack_floats([-0.1, -0.2, -0.3]), 0.5, [0.5], "stop", 3, 4, 1.0)
               for _ in range(n)]
    return P.RolloutGroup(lease_id, "gen-a", 7, 0, P.pack_ints([3, 4, 5]), samples, 0.9)


def test_round_trip_keeps_every_field():
    msg = _group()
    out, rid = P.decode(P.encode(msg, rid=42), limit=2**20)
    assert rid == 42
    assert out == msg
    assert list(P.unpack_ints(out.samples[0].token_ids)) == [5, 6, 1]
    lease = P.Lease(3, 1, [P.PromptItem(1, 0, "1 2 =", {"target": "1"})], {"temperature": 1.0})
    assert P.decode(P.encode(lease))[0] == lease


def test_arrays_travel_as_raw_bytes():
    body = msgpack.unpackb(P.encode(_group()), raw=False)
    assert isinstance(body["samples"][0]["token_ids"], bytes)
    assert body["v"] == P.SCHEMA_VERSION and body["k"] == "rollout_group"


def test_older_peer_without_appended_fields_still_decodes():
    body = msgpack.unpackb(P.encode(P.Heartbeat("g", 3)), raw=False)
    del body["lease_ids"]
    msg, _ = P.decode(msgpack.packb(body))
    assert msg.lease_ids == [] and msg.version == 3


@pytest.mark.parametrize("data, message", [
    (b"\xc1\xff\x00garbage", "not a valid MessagePack message"),
    (P.encode(P.Heartbeat("g", 1))[:-3], "not a valid MessagePack message"),
    (msgpack.packb([1, 2]), "expected a message map"),
    (msgpack.packb({"v": 1, "k": "nope"}), "unknown message kind 'nope'"),
    (msgpack.packb({"v": 99, "k": "heartbeat", "generator_id": "g"}), "Heartbeat: schema version 99"),
    (msgpack.packb({"v": 1, "k": "heartbeat", "generator_id": 5}), "Heartbeat.generator_id: expected str, got int"),
    (msgpack.packb({"v": 1, "k": "heartbeat"}), "Heartbeat.generator_id: missing"),
    (msgpack.packb({"v": 1, "k": "lease", "lease_id": 1, "min_version": 0, "groups": [{"prompt_id": "x"}]}),
     "Lease.groups[0].prompt_id: expected int, got str"),
])
def test_bad_messages_name_the_problem(data, message):
    with pytest.raises(P.ProtocolError) as e:
        P.decode(data)
    assert message in str(e.value)


def test_oversized_message_is_refused_before_decoding():
    with pytest.raises(P.ProtocolError, match="exceeds the limit of 100 bytes"):
        P.decode(P.encode(P.Error("x" * 200)), limit=100)


def test_rollout_array_checks():
    g = _group()
    P.check_rollout(g, 2)
    with pytest.raises(P.ProtocolError, match="run's group size is 3"):
        P.check_rollout(g, 3)
    g.samples[1].logprobs = P.pack_floats([0.0])
    with pytest.raises(P.ProtocolError, match=r"samples\[1\]: token_ids \(12 bytes\) and logprobs \(4 bytes\)"):
        P.check_rollout(g, 2)
