"""An agent worker's process (generator.agent_workers; its other side and the protocol: generator/agent_workers.py).

    python -m generator.agent_worker      the setup as JSON on stdin: the ROUTER's address, this worker's name, the
                                          run's config, the tokenizer's directory

It runs the agents of the samples it is sent with generator/agent.py's AgentRollout (each sample a session of its own
endpoint, the same timeouts and failures), whose engine is the generator's, asked by token ids (`RemoteEngine`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import sys

import msgpack

from generator.agent import AgentRollout
from generator.agent_workers import pack
from generator.rollout import AgentFailed, Context
from pipeline import protocol as P

log = logging.getLogger(__spec__.name)  # generator.agent_worker, also under python -m (where __name__ is "__main__")


class RemoteEngine:
    """The generator's engine as a worker's sessions see it: `generate` by token ids, over the worker's socket."""

    def __init__(self, sock):
        self.sock = sock
        self.waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()

    def bound(self, sid: int) -> _SampleEngine:
        return _SampleEngine(self, sid)

    async def call(self, sid: int, prompt_ids, sampling: P.Sampling, seed):
        from generator.engine import Completion

        cid = next(self._ids)
        self.waiting[cid] = future = asyncio.get_running_loop().create_future()
        try:
            await self.sock.send(pack("generate", sid, cid, list(prompt_ids), dataclasses.asdict(sampling), seed))
            out, error = await future
        finally:
            self.waiting.pop(cid, None)
        if error:
            raise RuntimeError(error)
        return [Completion(**out)]

    def answer(self, cid: int, out, error: str) -> None:
        future = self.waiting.get(cid)
        if future is not None and not future.done():
            future.set_result((out, error))


class _SampleEngine:
    def __init__(self, remote: RemoteEngine, sid: int):
        self.remote, self.sid = remote, sid

    async def generate(self, prompt_ids, n, sampling, seed=None, stop=()):
        assert n == 1 and not stop, "an endpoint session asks for one completion, stopped by the model's end of turn"
        return await self.remote.call(self.sid, prompt_ids, sampling, seed)


async def serve(setup: dict) -> None:
    import zmq
    import zmq.asyncio
    from transformers import AutoTokenizer

    from pipeline.config import config_from_dict

    cfg = config_from_dict(setup["config"])
    cfg.generator.agent_workers = 0  # this process runs its agents itself
    tok = AutoTokenizer.from_pretrained(setup["tokenizer"])
    rollout = AgentRollout(cfg, worker=True)  # vLLM's tool parsers imported at a first tool call only
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, setup["name"].encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(setup["address"])
    engine = RemoteEngine(sock)
    running: dict[int, asyncio.Task] = {}

    async def run(sid: int, item: dict, sampling: dict, seed, index: int) -> None:
        ctx = Context(1, P.Sampling(**sampling), tok, P.PromptItem(**item), seed)
        try:
            session, answer, failed = await rollout._sample(engine.bound(sid), ctx, index)
        except AgentFailed as e:
            await sock.send(pack("requeue", sid, str(e)))
            return
        finally:
            running.pop(sid, None)
        parts = [dataclasses.asdict(p) for p in session.parts]
        await sock.send(pack("done", sid, parts, session.extra, session.calls, answer, failed))

    async def orphaned(parent: int) -> None:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("agent worker %s: its generator is gone; stopping", setup["name"])
        os._exit(1)

    watchdog = asyncio.create_task(orphaned(os.getppid()))
    await rollout.prepare()  # at the worker's start, beside the others', not in its first agent's timeout
    await sock.send(pack("ready"))
    try:
        while True:
            kind, *args = msgpack.unpackb(await sock.recv(), raw=False)
            if kind == "sample":
                running[args[0]] = asyncio.create_task(run(*args))
            elif kind == "cancel" and args[0] in running:
                running[args[0]].cancel()
            elif kind == "completion":
                engine.answer(*args)
            elif kind == "stop":
                break
    finally:
        watchdog.cancel()
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        await rollout.aclose()
        sock.close(linger=0)


def main() -> None:
    # into the generator's log (its stderr): this process's own lines (the generator package's) at INFO, no library's
    # each request
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("generator").setLevel(logging.INFO)
    asyncio.run(serve(json.loads(sys.stdin.read())))


if __name__ == "__main__":
    main()
