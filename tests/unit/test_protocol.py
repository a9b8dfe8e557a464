import msgpack
import pytest

from pipeline import protocol as P

V = P.SCHEMA_VERSION


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
    lease = P.Lease(3, 1, [P.PromptItem(1, 0, "1 2 =", {"target": "1"})], P.Sampling(8, 1.0))
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
    (msgpack.packb({"v": 1, "k": "heartbeat", "generator_id": "g"}),
     f"Heartbeat: schema version 1, this side speaks {V}"),
    (msgpack.packb({"v": V, "k": "heartbeat", "generator_id": 5}), "Heartbeat.generator_id: expected str, got int"),
    (msgpack.packb({"v": V, "k": "heartbeat"}), "Heartbeat.generator_id: missing"),
    (msgpack.packb({"v": V, "k": "lease", "lease_id": 1, "min_version": 0, "groups": [{"prompt_id": "x"}]}),
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
    P.check_shape(g, 2)
    with pytest.raises(P.ProtocolError, match="run's group size is 3"):
        P.check_shape(g, 3)
    g.samples[1].logprobs = P.pack_floats([0.0])
    with pytest.raises(P.ProtocolError, match=r"samples\[1\]: token_ids \(12 bytes\) and logprobs \(4 bytes\)"):
        P.check_shape(g, 2)


@pytest.mark.parametrize("body, message", [
    # a few MB of empty maps would cost the decoder hundreds of MB: arrays and maps are bounded in length...
    ({"v": P.SCHEMA_VERSION, "k": "heartbeat", "generator_id": "g", "x": [{}] * 500_000}, "exceeds max_array_len"),
    # ...in number across the message...
    ({"v": P.SCHEMA_VERSION, "k": "heartbeat", "generator_id": "g", "x": [[{}] * 100] * 3}, "too many arrays"),
    # ...and in depth
    ({"v": P.SCHEMA_VERSION, "k": "heartbeat", "generator_id": "g", "x": [[[[[[[[[1]]]]]]]]]}, "deeper than 8"),
    ({"v": P.SCHEMA_VERSION, "k": "register", "generator_id": "g" * 129}, "Register.generator_id: 129 characters"),
    ({"v": P.SCHEMA_VERSION, "k": "register", "generator_id": "g", "host": "h" * 300}, "Register.host: 300 characters"),
])
def test_decoding_cost_and_string_fields_are_bounded(body, message):
    data = msgpack.packb(body)
    assert len(data) < P.FROM_PEER.bytes
    with pytest.raises(P.ProtocolError, match=message):
        P.decode(data)


def test_a_map_bomb_is_refused_quickly_and_cheaply():
    """4 MB of nested empty maps: refused after at most FROM_PEER.containers maps are built."""
    import time
    import tracemalloc

    data = msgpack.packb({"v": P.SCHEMA_VERSION, "k": "heartbeat", "generator_id": "g",
                          "x": [[{}] * 4000 for _ in range(1000)]})
    tracemalloc.start()
    t = time.perf_counter()
    with pytest.raises(P.ProtocolError, match="too many arrays and maps"):
        P.decode(data, limit=len(data))
    elapsed = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"{len(data) / 1e6:.1f} MB bomb refused in {elapsed * 1000:.1f} ms, peak {peak / 1e6:.1f} MB")
    assert peak < 1e6  # unbounded, these 4M maps take several hundred MB


def test_typed_payloads_round_trip_and_are_checked():
    welcome = P.Welcome("run", "g", 3, "tcp://h:1", "nccl", 1.0, P.Sampling(8, 0.7),
                        collective=P.CollectiveSetup(5555, 2, "gloo", 60.0))
    assert P.decode(P.encode(welcome))[0] == welcome
    plain = P.Welcome("run", "g", 3, "tcp://h:1", "zmq", 1.0, P.Sampling(8, 0.7))
    assert P.decode(P.encode(plain))[0].collective is None
    status = P.StatusReply("run", 1, 1, 2, 0, 0, 0, 0, {"rollouts": 3},
                           generators=[P.GeneratorStatus("g", "h", "0", 1, 0)])
    assert P.decode(P.encode(status), limits=P.FROM_HUB)[0] == status
    body = msgpack.unpackb(P.encode(status), raw=False)
    body["counters"] = {"rollouts": "many"}
    with pytest.raises(P.ProtocolError, match=r"StatusReply.counters\['rollouts'\]: expected int, got str"):
        P.decode(msgpack.packb(body))
    body = msgpack.unpackb(P.encode(welcome), raw=False)
    body["sampling"] = {"temperature": 1.0}
    with pytest.raises(P.ProtocolError, match="Welcome.sampling.max_tokens: missing"):
        P.decode(msgpack.packb(body))


async def test_a_reply_in_another_schema_version_fails_its_request_at_once():
    """A hub of another release: the generator's request fails with SchemaMismatch (the generator exits), instead
    of timing out and being retried forever."""
    import asyncio

    import zmq
    import zmq.asyncio

    from pipeline.client import HubClient

    ctx = zmq.asyncio.Context.instance()
    hub = ctx.socket(zmq.ROUTER)
    port = hub.bind_to_random_port("tcp://127.0.0.1")
    client = HubClient(f"tcp://127.0.0.1:{port}", timeout=30.0)

    async def answer():
        ident, data = await hub.recv_multipart()
        _, rid = P.decode(data)
        await hub.send_multipart([ident, msgpack.packb({"v": P.SCHEMA_VERSION + 1, "k": "error", "r": rid,
                                                        "message": "x"})])

    task = asyncio.ensure_future(answer())
    with pytest.raises(P.SchemaMismatch, match="schema version"):
        await asyncio.wait_for(client.request(P.Heartbeat("g")), 10)
    await task
    client.close()
    hub.close(linger=0)
