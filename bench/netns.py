"""Two hosts on one machine for benchmarks: Linux network namespaces joined by a veth pair (root and iproute2),
each with its own address, loopback and /etc/hosts (its hostname resolves to its own address, as on a real host:
gloo binds that address). Nothing but the file system is shared; `prefix(host)` runs a program on a host."""

from __future__ import annotations

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


class HostPair:
    """Hosts "a" (SUBNET.1) and "b" (SUBNET.2), made on entry and removed on exit."""

    def __init__(self):
        tag = f"bench{os.getpid()}"
        self.ns = {"a": f"{tag}-a", "b": f"{tag}-b"}
        self.address = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}

    def __enter__(self) -> HostPair:
        try:
            for host, ns in self.ns.items():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "dev", "lo", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.address[host]} {socket.gethostname()}\n")
            _ip("link", "add", "eth0", "netns", self.ns["a"], "type", "veth", "peer", "name", "eth0", "netns",
                self.ns["b"])
            for host, ns in self.ns.items():
                _ip("-n", ns, "addr", "add", f"{self.address[host]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "dev", "eth0", "up")
        except OSError:
            self.__exit__()
            raise
        return self

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host]]

    def __exit__(self, *exc) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
