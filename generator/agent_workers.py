"""`generator.agent_workers: N`: `builtin:agent`'s agents run in N processes of their own, off the generator's loop.

Why: an agent and its openai client are Python on the generator's one event loop, where vLLM's output handler, the
heartbeats and the endpoint's routes also run. On a GPU that loop was the bound of a tool-calling run: of its time,
the agents' openai clients took half, the SDK's request transform alone a quarter (docs/figures.md, "Agents through
the endpoint"). As verl's agent loop workers do, each worker runs the agents of the samples sent to it, each with a
session of the endpoint in that worker (generator/endpoint.py: the same routes, keys, refusals, chat template and
token tracking, generator/agent.py's timeouts and failures), and asks the generator's engine for each completion by
token ids. What the generator's loop does per call is then what a rollout calling the engine does: a message in,
`engine.generate`, a message out.

    generator -> worker   ("sample", sid, item, sampling, seed, index)    a sample to run
                          ("cancel", sid)                                  its group no longer wants it
                          ("completion", cid, completion or None, error)   the answer to a "generate"
                          ("stop",)
    worker -> generator   ("ready",)
                          ("generate", sid, cid, prompt_ids, sampling, seed)
                          ("done", sid, parts, extra, calls, answer, failed) or ("requeue", sid, why)

One ZeroMQ ROUTER in the generator, bound to an ipc path in a directory of its own (mode 0700: no other user
connects), a DEALER in each worker, msgpack frames; a frame that is not one of these is dropped and counted. The
worker gets the run's config and the generator's tokenizer (saved into that directory) at its start. Version labels
are the engine's: each completion carries the versions that sampled it, and the parts come back as the session
recorded them. A worker that dies fails the samples it held as an agent that raised does (generator.agent_failure),
naming the worker and its exit; the next sample starts another. Workers stop with the rollout (its `aclose`) or,
orphaned, within a second of their parent's end. The worker's process: generator/agent_worker.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgpack

from generator.agent_sessions import Part
from generator.rollout import AgentFailed, Context
from pipeline import protocol as P

log = logging.getLogger(__name__)
READY_S = 300.0  # a worker's start (imports, the tokenizer, vLLM's tool parser) must not take longer
STOP_S = 10.0  # after "stop", a worker still running is killed


@dataclass
class Ran:
    """What a worker's session of one sample recorded (generator/agent.py builds the trajectories from it)."""

    parts: list[Part] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    calls: int = 0


def pack(*msg) -> bytes:
    """One message of the protocol above: msgpack of (kind, *fields)."""
    return msgpack.packb(msg, use_bin_type=True)


class AgentWorkers:
    """The generator's side: the workers, the samples each holds, and the engine calls they make."""

    def __init__(self, cfg, count: int):
        self.cfg, self.count, self.failure = cfg, count, cfg.generator.agent_failure
        self.procs: dict[bytes, asyncio.subprocess.Process] = {}
        self.samples: dict[int, tuple[bytes, asyncio.Future, Any]] = {}  # sid -> (worker, its result, the engine)
        self.calls: dict[int, set[asyncio.Task]] = {}  # sid -> its engine calls running
        self.refused = 0  # frames that were not a message of this protocol
        self._ready: dict[bytes, asyncio.Future] = {}
        self._ids = itertools.count()
        self._names = itertools.count()
        self._lock = asyncio.Lock()
        self._dir: str | None = None
        self._sock: Any = None
        self._reader: asyncio.Task | None = None
        self._watchers: set[asyncio.Task] = set()
        self._stopping = False

    async def sample(self, engine, ctx: Context, index: int) -> tuple[Ran, str, str]:
        """Sample `index` of ctx's group, run by a worker: (what its session recorded, the answer, why it failed)."""
        name = await self._worker(ctx.tokenizer)
        sid, future = next(self._ids), asyncio.get_running_loop().create_future()
        self.samples[sid] = (name, future, engine)
        item = dataclasses.asdict(ctx.item)
        try:
            self._send(name, "sample", sid, item, dataclasses.asdict(ctx.sampling), ctx.seed, index)
            return await future
        except WorkerDied as e:  # as an agent that raised: zero or requeue
            log.warning("agent for prompt %d failed: %s", ctx.item.prompt_id, e)
            if self.failure == "requeue":
                raise AgentFailed(f"agent_error: {e}") from None
            return Ran(), "", "agent_error"
        finally:
            del self.samples[sid]
            if not future.done():  # cancelled: the worker stops it
                with contextlib.suppress(Exception):
                    self._send(name, "cancel", sid)
            for task in self.calls.pop(sid, set()):
                task.cancel()

    async def aclose(self) -> None:
        """Stop every worker (by its process id past STOP_S) and remove the socket's directory."""
        self._stopping = True
        for name in list(self.procs):
            with contextlib.suppress(Exception):
                self._send(name, "stop")
        for name, proc in list(self.procs.items()):
            try:
                await asyncio.wait_for(proc.wait(), STOP_S)
            except TimeoutError:
                log.warning("agent worker %s did not stop within %.0f s: killed", name.decode(), STOP_S)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for task in [self._reader, *self._watchers]:
            if task is not None:
                task.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def _worker(self, tok) -> bytes:
        """The worker with the fewest samples, the workers (re)started first where fewer than `count` run, all at
        once (one after another, 8 workers took 67 s to serve their first samples on 2 cores against 12 s for the
        agents on the generator's loop: each start imports transformers and loads the tokenizer)."""
        async with self._lock:
            if self._sock is None:
                self._bind(tok)
            if len(self.procs) < self.count:
                await asyncio.gather(*(self._start() for _ in range(self.count - len(self.procs))))
        held = collections.Counter(name for name, _, _ in self.samples.values())
        return min(self.procs, key=lambda n: held[n])

    def _bind(self, tok) -> None:
        import zmq
        import zmq.asyncio

        self._dir = tempfile.mkdtemp(prefix="pipeline-agents-")  # mode 0700
        tok.save_pretrained(os.path.join(self._dir, "tokenizer"))
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"ipc://{self._dir}/sock")
        self._reader = asyncio.create_task(self._read())

    async def _start(self) -> None:
        assert self._dir is not None
        name = f"agents-{os.getpid()}-{next(self._names)}".encode()
        self._ready[name] = asyncio.get_running_loop().create_future()
        setup = {"address": f"ipc://{self._dir}/sock", "name": name.decode(), "config": self.cfg.to_dict(),
                 "tokenizer": os.path.join(self._dir, "tokenizer")}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the agent imports as here
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "generator.agent_worker",
                                                    stdin=asyncio.subprocess.PIPE, env=env)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(setup).encode())
        await proc.stdin.drain()
        proc.stdin.close()
        self.procs[name] = proc
        watcher = asyncio.create_task(self._watch(name, proc))
        self._watchers.add(watcher)
        ready = self._ready[name]
        done, _ = await asyncio.wait([ready, watcher], timeout=READY_S, return_when=asyncio.FIRST_COMPLETED)
        del self._ready[name]
        if ready not in done:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise RuntimeError(f"agent worker {name.decode()} did not start within {READY_S:.0f} s (exit code "
                               f"{proc.returncode}); its error is in this generator's log above")
        log.info("agent worker %s (pid %d) started", name.decode(), proc.pid)

    async def _watch(self, name: bytes, proc) -> None:
        code = await proc.wait()
        self.procs.pop(name, None)
        if self._stopping:
            return
        why = f"agent worker {name.decode()} (pid {proc.pid}) exited with code {code}"
        held = [future for held_by, future, _ in self.samples.values() if held_by == name and not future.done()]
        log.warning("%s; its %d samples fail", why, len(held))
        for future in held:
            future.set_exception(WorkerDied(why))

    def _send(self, name: bytes, *msg) -> None:
        import zmq

        self._sock.send_multipart([name, pack(*msg)], flags=zmq.NOBLOCK)

    async def _read(self) -> None:
        while True:
            name, raw = await self._sock.recv_multipart()
            try:
                kind, *args = msgpack.unpackb(raw, raw=False)
                self._handle(name, kind, args)
            except Exception as e:  # a frame of no message of ours: dropped, counted, named
                self.refused += 1
                log.warning("agent worker %s: a message dropped (%s: %s)", name[:40], type(e).__name__, e)

    def _handle(self, name: bytes, kind: str, args: list) -> None:
        if kind not in ("ready", "generate", "done", "requeue"):
            raise ValueError(f"unknown message kind {kind!r}")
        if kind == "ready":
            self._ready[name].set_result(None)
            return
        sid = args[0]
        entry = self.samples.get(sid)
        if entry is None or entry[0] != name:  # ended, cancelled, or another worker's: nothing to do
            if kind == "generate":
                self._send(name, "completion", args[1], None, "the sample has ended")
            return
        _, future, engine = entry
        if kind == "generate":
            cid, prompt_ids, sampling, seed = args[1:]
            task = asyncio.create_task(self._generate(name, engine, cid, prompt_ids, P.Sampling(**sampling), seed))
            self.calls.setdefault(sid, set()).add(task)
            task.add_done_callback(self.calls[sid].discard)
        elif kind == "done" and not future.done():
            parts, extra, calls, answer, failed = args[1:]
            parts = [Part(**p | {"turns": [tuple(t) for t in p["turns"]]}) for p in parts]
            future.set_result((Ran(parts, extra, calls), answer, failed))
        elif kind == "requeue" and not future.done():
            future.set_exception(AgentFailed(args[1]))

    async def _generate(self, name: bytes, engine, cid: int, prompt_ids: list[int], sampling: P.Sampling,
                        seed: int | None) -> None:
        reply: tuple[dict | None, str]
        try:
            (out,) = await engine.generate(prompt_ids, 1, sampling, seed=seed)
            reply = (vars(out), "")  # its fields as they are: asdict would copy each token id (issue 51's profile)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the endpoint answers it as the engine's error (500), as in the generator
            reply = (None, f"{type(e).__name__}: {e}")
        if name in self.procs:
            self._send(name, "completion", cid, *reply)


class WorkerDied(Exception):
    pass
