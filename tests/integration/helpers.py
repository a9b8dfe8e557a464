"""Helpers for the integration tests: start a learner and generators as real processes."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from pipeline import protocol as P
from pipeline.host import processes
from pipeline.metrics import read_jsonl, read_metrics
from tests.conftest import wait_for


def start_learner(procs, run_dir: Path, port: int, overrides: list[str], extra: list[str] = (),
                  env: dict | None = None) -> object:
    run_dir.mkdir(parents=True, exist_ok=True)
    args = ["learner", "-c", "configs/demo.yaml", "--run-dir", str(run_dir), "--set", f"hub.port={port}"]
    for o in overrides:
        args += ["--set", o]
    return procs([*args, *extra], run_dir.parent / f"{run_dir.name}-learner.log", env)


def start_generator(procs, run_dir: Path, port: int, overrides: list[str], name: str = "gen", env: dict | None = None,
                    host: str = "127.0.0.1"):
    args = ["generator", "-c", "configs/demo.yaml", "--learner", f"tcp://{host}:{port}"]
    for o in overrides:
        args += ["--set", o]
    return procs(args, run_dir.parent / f"{run_dir.name}-{name}.log", env)


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for child, (_, ppid, _) in processes().items():
        children.setdefault(ppid, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        out.append((p, f"{comm} {cmd}"))
        todo += children.get(p, [])
    return out


def events(run_dir: Path, name: str | None = None, after: int = 0) -> list[dict]:
    """The hub's events (RUN_DIR/events.jsonl) from the `after`-th on, those named `name` where it is given."""
    return [e for e in read_jsonl(run_dir / "events.jsonl")[after:] if name is None or e["event"] == name]


def held_at(step: int, release: Path | None = None) -> dict:
    """The environment of a learner that waits after version `step` until the file `release` exists (None: until it
    is killed): the test hooks of pipeline/environment.py held_at_step."""
    return {"PIPELINE_TEST_HOLD_AT_STEP": str(step), **({"PIPELINE_TEST_RELEASE": str(release)} if release else {})}


def wait_steps(run_dir: Path, n: int, timeout: float, watch) -> list[dict]:
    return wait_for(lambda: (lambda r: r if len(r) >= n else None)(read_metrics(run_dir)),
                    timeout, f"{n} learner steps", watch)


class Sink:
    """Stands for a generator's rollouts socket in-process: keeps each group it is sent, decoded."""

    def __init__(self):
        self.sent = []

    async def send(self, data, copy=False):
        self.sent.append(P.decode(data, limits=P.FROM_HUB)[0])


class Gate:
    """A TCP relay to the hub's control port that lets nothing through until `open()`: a generator given `port`
    starts its engine at once, then knocks (its registration's connection, which ZeroMQ retries every 0.1 s) until
    the test opens the gate. Engines so start side by side, `knocked` says when each one is up, and each joins the run
    when the test wants it to. A context manager: the relay stops at its end."""

    def __init__(self, hub_port: int):
        self.hub_port, self.opened, self.knocked = hub_port, threading.Event(), threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self.server.close()

    def open(self) -> None:
        self.opened.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            if not self.opened.is_set():  # turned away: ZeroMQ connects again
                self.knocked.set()
                client.close()
                continue
            try:
                hub = socket.create_connection(("127.0.0.1", self.hub_port))
            except OSError:  # the hub is gone: so is this connection
                client.close()
                continue
            for src, dst in ((client, hub), (hub, client)):
                threading.Thread(target=_relay, args=(src, dst), daemon=True).start()


def _relay(src: socket.socket, dst: socket.socket) -> None:
    """Copy until either side closes, then close both ways."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        src.close()
