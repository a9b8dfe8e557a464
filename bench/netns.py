"""Hosts on one machine, for benchmarks and tests: Linux network namespaces (root and iproute2), each with its own
address, loopback and /etc/hosts (its hostname resolves to its own address, as on a real host: gloo binds that
address). Nothing but the file system is shared; `prefix(host)` runs a program on a host.

    Hosts     any number on one switch (a bridge in a namespace of its own); `cut(host)` pulls a host's cable: its
              switch port goes down, and nothing (no FIN, no RST) tells the others (tests/integration/test_hosts.py)
    HostPair  "a" and "b" joined by a veth pair (bench.weight_sync --netns)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from pathlib import Path

SUBNET = "10.97.0"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def remove_stale(prefix: str) -> list[str]:
    """Remove the namespaces PREFIXPID-... (and their /etc/netns folders) whose process PID is gone: a run killed
    without its teardown (a CI time-out's SIGTERM to pytest) leaves them. Returns their names."""
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    except OSError:
        return []
    stale = []
    for ns in names:
        pid = ns.removeprefix(prefix).split("-")[0]
        if ns.startswith(prefix) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
            stale.append(ns)
    return stale


class Hosts:
    """Namespaces named TAG-HOST, host i at SUBNET.i; all removed by `remove` (or at the end of a `with`)."""

    def __init__(self, tag: str, subnet: str = SUBNET):
        self.tag, self.subnet = tag, subnet
        self.ns: dict[str, str] = {}  # host -> its namespace
        self.address: dict[str, str] = {}
        self.made: list[str] = []  # namespaces, the switch's too

    def __enter__(self) -> Hosts:
        try:
            self.open()
        except OSError:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def open(self) -> None:
        """The switch: OSError where namespaces or bridges cannot be made (not root, no iproute2)."""
        self.switch = self._namespace("switch")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "dev", "br0", "up")

    def add(self, host: str) -> str:
        """A host with its eth0 on the switch; returns its address."""
        self._host(host)
        _ip("link", "add", "eth0", "netns", self.ns[host], "type", "veth", "peer", "name", host, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", "dev", host, "master", "br0", "up")
        self._up(host)
        return self.address[host]

    def cut(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", "dev", host, "down")

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host]]

    def remove(self) -> None:
        for ns in reversed(self.made):
            with contextlib.suppress(OSError):  # no iproute2: nothing was made
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.made = []

    def _namespace(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        _ip("netns", "add", ns)
        self.made.append(ns)
        _ip("-n", ns, "link", "set", "dev", "lo", "up")
        return ns

    def _host(self, host: str) -> None:
        """Its namespace, address and /etc/hosts (`ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts)."""
        self.ns[host], self.address[host] = self._namespace(host), f"{self.subnet}.{len(self.ns) + 1}"
        etc = Path("/etc/netns") / self.ns[host]
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address[host]} {socket.gethostname()}\n")

    def _up(self, host: str) -> None:
        _ip("-n", self.ns[host], "addr", "add", f"{self.address[host]}/24", "dev", "eth0")
        _ip("-n", self.ns[host], "link", "set", "dev", "eth0", "up")


class HostPair(Hosts):
    """Hosts "a" (SUBNET.1) and "b" (SUBNET.2), made on entry and removed on exit."""

    def __init__(self):
        super().__init__(f"bench{os.getpid()}")

    def open(self) -> None:
        for host in ("a", "b"):
            self._host(host)
        _ip("link", "add", "eth0", "netns", self.ns["a"], "type", "veth", "peer", "name", "eth0", "netns",
            self.ns["b"])
        for host in ("a", "b"):
            self._up(host)
