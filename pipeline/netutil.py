"""Small network helpers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (another process may take it before it is bound again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_bindable(host), 0))
        return s.getsockname()[1]


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
