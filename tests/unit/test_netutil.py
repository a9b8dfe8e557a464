"""A port chosen seconds before its process binds it (the hub's, by `pipeline run`): outside the kernel's ephemeral
range, which every socket bound to port 0 and every outgoing connection draw from (a learner found its hub's port
taken so in the suite), free when chosen, and drawn at random (two launchers at once do not pick alike)."""

from __future__ import annotations

import socket

from pipeline import netutil


def test_a_reserved_port_is_free_and_outside_the_ephemeral_range():
    low, high = netutil._ephemeral()
    ports = [netutil.reserved_port() for _ in range(50)]
    assert all(p >= netutil.LOWEST and not low <= p <= high for p in ports), ports
    assert all(netutil.port_free("127.0.0.1", p) for p in ports)
    assert len(set(ports)) > 40  # drawn at random, not in a sequence two launchers would share
    drawn = []  # what the kernel hands out meanwhile: none of the reserved ports can be among them
    for _ in range(100):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        drawn.append(s)
    try:
        assert all(low <= s.getsockname()[1] <= high for s in drawn)
    finally:
        for s in drawn:
            s.close()
