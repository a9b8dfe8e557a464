"""Small network helpers."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: ports services commonly claim


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (another process may take it before it is bound again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_bindable(host), 0))
        return s.getsockname()[1]


def reserved_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, outside the kernel's ephemeral range (net.ipv4.ip_local_port_range), for a port
    chosen seconds before its process binds it (the hub's, chosen by `pipeline run` before the learner starts). The
    kernel hands out ephemeral ports to every socket bound to port 0 and every outgoing connection: in the suite a
    learner found its hub's port taken ("Address already in use") by another process's socket in those seconds.
    Outside that range only a process naming the port itself can take it. `free_port` where the range leaves none."""
    low, high = _ephemeral()
    ranges = [(a, b) for a, b in ((LOWEST, low - 1), (high + 1, 65535)) if a <= b]
    rng = random.SystemRandom()  # not the run's seeded generator: two launchers would pick alike
    for _ in range(100 if ranges else 0):
        port = rng.randint(*rng.choice(ranges))
        if port_free(host, port):
            return port
    return free_port(host)


def _ephemeral() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in EPHEMERAL.read_text().split())
        return low, high
    except (OSError, ValueError):  # not Linux: the IANA range, which the others use
        return 49152, 65535


def port_free(host: str, port: int) -> bool:
    """Whether TCP `port` can be bound on `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((_bindable(host), port))
        except OSError:
            return False
        return True


def local_address(host: str, port: int) -> str:
    """The address a process on this host connects to for a socket bound on `host`: loopback for every interface."""
    return f"tcp://{'127.0.0.1' if host in ('0.0.0.0', '*') else host}:{port}"


def _bindable(host: str) -> str:
    return "0.0.0.0" if host == "*" else host
