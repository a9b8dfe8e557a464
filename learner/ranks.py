"""Which of the learner's ranks is gone, when a collective fails.

A collective to a rank whose process died fails at once (gloo: "Connection closed by peer"; nccl: an error once
the watchdog aborts), and one to a rank whose host vanished fails after trainer.rank_timeout_s. Either error
names an address at best, not a rank. So at start every rank opens a listening socket (the kernel answers a
connection while the process lives, no thread needed) and the ranks exchange (rank, host, pid, address) once.
When a collective fails, the rank that saw it knocks on every other rank's socket: refused (the process is gone)
or unanswered within PROBE_S (its host is gone) means lost. The message names those ranks and their hosts.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

PROBE_S = 3.0  # a rank on a live host answers a connection within this


class RankLost(RuntimeError):
    """A learner rank is gone: the run cannot go on (continue it with --resume)."""


@dataclass(frozen=True)
class Member:
    rank: int
    host: str
    pid: int
    address: str
    port: int

    def __str__(self) -> str:
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"


class Roster:
    """Every rank's Member, gathered once after the process group starts."""

    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.listener = socket.create_server(("0.0.0.0", 0), backlog=64)
        me = Member(rank, socket.gethostname(), os.getpid(), _own_address(), self.listener.getsockname()[1])
        members: list = [None] * world
        dist.all_gather_object(members, me)
        self.members: list[Member] = members

    def lost(self) -> list[Member]:
        """The other ranks that do not answer now."""
        return [m for m in self.members if m.rank != self.rank and not _answers(m)]

    def explain(self, error: BaseException, linger: bool = True) -> RankLost | None:
        """RankLost naming the ranks that are gone, if any is; None when every rank still answers (the error is
        another one). `linger`: ask again a moment later, and stay PROBE_S in all, so that a rank that saw the same
        failed collective does not take this one for lost by probing it after it ended. Not after a signal (`linger`
        False): every rank of a stopped run heard it, and one that lingered would be probed by one that ended."""
        lost = self.lost()
        if linger:
            try:
                time.sleep(PROBE_S / 3)
                lost = lost or self.lost()  # a killed rank's connections close a moment before its listening socket
                time.sleep(PROBE_S * 2 / 3)  # (the ranks that saw the failure too are still here: they linger)
            except KeyboardInterrupt:  # its agent stops this rank meanwhile (its rendezvous lost the node too): the
                pass  # run ends either way, and what was found is why
        if not lost:
            return None
        names = ", ".join(str(m) for m in lost)
        return RankLost(f"learner {names} is gone ({type(error).__name__}: {str(error)[:300]}); this was rank "
                        f"{self.rank} of {self.world} on host {socket.gethostname()}. The run stops here; continue "
                        "it from its newest checkpoint with the same command and --resume RUN_DIR")

    def close(self) -> None:
        self.listener.close()


def _answers(m: Member) -> bool:
    try:
        socket.create_connection((m.address, m.port), timeout=PROBE_S).close()
        return True
    except OSError:
        return False


def _own_address() -> str:
    """The address this host is reached at from rank 0's host (MASTER_ADDR): the interface of the route there."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
