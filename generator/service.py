"""The generator service: register with the hub, take leases, generate groups, push rollouts.

    register -> Welcome (version, transport, endpoints)
    tasks:   heartbeat   every heartbeat_s; the reply lists dead leases and the latest weights
             weights     WeightsReady announcements -> fetch -> engine.load -> WeightsApplied
             leases      LeaseRequest while there is room in the engine -> one task per prompt group
A lost hub (no reply within the timeout) tears the session down and re-registers with back-off;
the engine stays warm. The first SIGTERM/SIGINT drains: a heartbeat tells the hub at once (an nccl
generator takes no more broadcasts: its engine may be stopping too), then finish groups, return leases,
Leave, exit 0. A second one leaves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid

import zmq
import zmq.asyncio

from pipeline import protocol as P
from pipeline.client import HubClient
from pipeline.config import Config
from pipeline.tasks import load_reward_fns, score
from pipeline.transports import host_identity, make_receiver

log = logging.getLogger(__name__)


class Reregister(Exception):
    """The hub does not know this generator (it restarted or dropped us): register again."""


class Generator:
    def __init__(self, cfg: Config, engine, tokenizer, address: str, gpus: str = ""):
        self.cfg, self.engine, self.tok, self.address = cfg, engine, tokenizer, address
        self.gpus = gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "")  # reported: `auto` picks nccl for GPUs
        host, boot = host_identity()
        self.host, self.boot_id = host, boot
        self.id = f"gen-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rewards = load_reward_fns(cfg.rewards)
        self.ctx = zmq.asyncio.Context()
        self.stopping = 0  # 1: draining, 2: leave now
        self.draining = asyncio.Event()  # a signal started the drain: the hub is told at once (no more broadcasts)
        self.groups: dict[asyncio.Task, int] = {}  # group task -> lease id
        self.tokens = 0
        self.started = time.monotonic()
        self.leases_seen: set[int] = set()

    # ---- lifecycle ------------------------------------------------------------------------------

    async def run(self, handle_signals: bool = True) -> None:
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, self._on_signal)
        backoff = 0.5
        while self.stopping < 2:
            try:
                await self._session()
                return
            except (P.PeerLost, Reregister, P.ProtocolError) as e:
                if self.stopping:
                    return
                log.warning("generator %s: %s; reconnecting in %.1f s (engine stays warm)", self.id, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    def _on_signal(self) -> None:
        self.stopping += 1
        self.draining.set()
        log.info("generator %s: %s", self.id, "draining (Ctrl-C again to leave now)" if self.stopping == 1 else
                 "leaving now")
        if self.stopping >= 2:
            for t in list(self.groups):
                t.cancel()

    async def _session(self) -> None:
        client = HubClient(self.address, timeout=max(10.0, 3 * self.cfg.hub.heartbeat_s))
        try:
            welcome = await client.request(P.Register(self.id, self.host, self.boot_id, self.gpus, os.getpid(),
                                                      self.engine.version, self.cfg.generator.tensor_parallel_size),
                                           timeout=10.0)
            if not isinstance(welcome, P.Welcome):
                raise P.PeerLost(f"registration refused: {getattr(welcome, 'message', welcome)}")
            log.info("generator %s registered (learner version %d, transport %s)", self.id, welcome.version,
                     welcome.transport)
            self.welcome, self.client = welcome, client
            self.receiver = make_receiver(welcome.transport, client, self.cfg.weights.chunk_mb)
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.SNDHWM, 1000)
            self.push.setsockopt(zmq.LINGER, 5000)  # ms: flush queued rollouts on the way out
            self.push.connect(welcome.rollouts_endpoint)
            self.announced: asyncio.Queue = asyncio.Queue()
            self.version_changed = asyncio.Condition()
            if welcome.collective:  # nccl: meet the learner in this generator's process group
                try:
                    await self.engine.init_collective(_host_of(self.address), welcome.collective)
                except Exception as e:  # the hub hears of it at re-registration (auto: a file transport then)
                    raise Reregister(f"nccl process group not joined: {e}") from e
            if welcome.latest and welcome.latest["version"] != self.engine.version:
                await self._apply(P.from_dict(P.WeightsReady, welcome.latest))
            await self._run_tasks()
            await client.request(P.Leave(self.id, sorted(set(self.groups.values()))), timeout=5.0)
            log.info("generator %s left", self.id)
        finally:
            for t in list(self.groups):
                t.cancel()
            self.groups.clear()
            client.close()
            if hasattr(self, "push"):
                self.push.close(linger=2000)

    async def _run_tasks(self) -> None:
        """Run until the lease loop ends (drained or run complete); a failing background task ends it too."""
        leases = asyncio.create_task(self._leases())
        tasks = [leases] + [asyncio.create_task(c) for c in (self._heartbeats(), self._weights(), self._subscribe(),
                                                              self._pushed())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # surfaces PeerLost / Reregister
                if t is not leases:
                    raise RuntimeError(f"background task {t.get_coro().__name__} ended unexpectedly")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- background tasks -----------------------------------------------------------------------

    async def _heartbeats(self) -> None:
        while True:
            draining = self.draining.is_set()
            reply = await self.client.request(P.Heartbeat(
                self.id, self.engine.version, self.tokens / max(1e-6, time.monotonic() - self.started),
                len(self.groups), sorted(set(self.groups.values())), draining))
            if isinstance(reply, P.Error):
                if reply.fatal:
                    raise Reregister(reply.message)
                log.warning("heartbeat: %s", reply.message)
            elif isinstance(reply, P.Ack):
                dead = set(reply.info.get("dead_leases", []))
                for t, lease_id in list(self.groups.items()):
                    if lease_id in dead:
                        t.cancel()
                latest = reply.info.get("latest")
                if latest and latest["version"] > self.engine.version:
                    self.announced.put_nowait(P.from_dict(P.WeightsReady, latest))
            if draining:
                await asyncio.sleep(self.welcome.heartbeat_s)
            else:  # a drain is reported at once
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.draining.wait(), self.welcome.heartbeat_s)

    async def _subscribe(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.welcome.weights_endpoint)
        try:
            while True:
                data = await sub.recv()
                try:
                    msg, _ = P.decode(data)
                except P.ProtocolError as e:
                    log.warning("bad weights announcement: %s", e)
                    continue
                if isinstance(msg, P.WeightsReady):
                    self.announced.put_nowait(msg)
        finally:
            sub.close(linger=0)

    async def _pushed(self) -> None:
        """Announcements the hub sends on the control channel (the nccl transport's)."""
        while True:
            msg = await self.client.pushed.get()
            if isinstance(msg, P.WeightsReady):
                self.announced.put_nowait(msg)

    async def _weights(self) -> None:
        while True:
            ready = await self.announced.get()
            if ready.collective != self.receiver.collective:
                continue  # announcements of the other kind of transport
            if ready.collective and self.draining.is_set():
                continue  # the hub closes a draining generator's group: it sends no more broadcasts
            if ready.collective:  # every broadcast must be received, in order: the learner is sending it
                await self._apply(ready)
                continue
            while not self.announced.empty():  # files: skip to the newest announced version
                newer = self.announced.get_nowait()
                if not newer.collective and newer.version > ready.version:
                    ready = newer
            if ready.version > self.engine.version:
                await self._apply(ready)

    async def _apply(self, ready: P.WeightsReady) -> None:
        start = time.perf_counter()
        try:
            if ready.collective:
                stopped_ms = await self.engine.load_collective(ready.version, ready.manifest)
            else:
                path = await self.receiver.fetch(ready)  # verified against the announced checksum
                stopped_ms = await self.engine.load(path, None, ready.version)
        except (P.ProtocolError, asyncio.CancelledError):
            raise
        except Exception as e:  # e.g. a broadcast that timed out: a new registration builds a new group
            if ready.collective and self.draining.is_set():  # the hub aborted the group of a draining generator
                log.info("generator %s: weights v%d not received while draining (%s)", self.id, ready.version, e)
                return
            raise Reregister(f"weights v{ready.version} could not be loaded: {e}") from e
        total_ms = (time.perf_counter() - start) * 1000
        swap = self.engine.last_swap_ms
        log.info("weights v%d applied: %.0f ms (%.0f ms stopped), %.0f ms after the optimizer step; %spausing took "
                 "%.0f ms, the load call %.0f ms, of which %.0f ms in the workers", ready.version, total_ms, stopped_ms,
                 (time.time() - ready.published_at) * 1000 if ready.published_at else 0,
                 f"received in {swap['receive']:.0f} ms while generating; " if "receive" in swap else "",
                 swap.get("pause", 0), swap.get("load", 0), swap.get("worker", 0))
        async with self.version_changed:
            self.version_changed.notify_all()
        await self.client.request(P.WeightsApplied(self.id, ready.version, total_ms, self.receiver.via))

    async def _leases(self) -> None:
        room = asyncio.Event()
        cap = self.cfg.generator.max_inflight_groups
        while not self.stopping:
            free = cap - len(self.groups)
            if free <= 0:
                room.clear()
                await room.wait()
                continue
            reply = await self.client.request(P.LeaseRequest(self.id, min(free, self.cfg.generator.lease_size)))
            if isinstance(reply, P.Wait):
                if reply.reason == "run complete":
                    log.info("generator %s: the run is complete at version %d", self.id, reply.version)
                    self.stopping = max(self.stopping, 1)
                    await self._wait_version(reply.version, timeout=30.0)  # acknowledge the final weights
                    break
                await asyncio.sleep(reply.retry_s)
                continue
            if isinstance(reply, P.Error):
                if reply.fatal:
                    raise Reregister(reply.message)
                raise P.ProtocolError(f"lease refused: {reply.message}")
            await self._wait_version(reply.min_version)  # k = 0: generate only on the newest weights
            for item in reply.groups:
                task = asyncio.create_task(self._group(reply, item))
                self.groups[task] = reply.lease_id
                task.add_done_callback(lambda t: (self.groups.pop(t, None), room.set()))
        while self.groups:  # draining: let the groups in flight finish
            await asyncio.sleep(0.05)

    async def _wait_version(self, version: int, timeout: float | None = None) -> None:
        async def loaded() -> None:
            async with self.version_changed:
                await self.version_changed.wait_for(lambda: self.engine.version >= version)

        try:
            await asyncio.wait_for(loaded(), timeout)
        except TimeoutError:
            log.warning("generator %s: weights v%d did not arrive within %s s", self.id, version, timeout)

    # ---- one prompt group -----------------------------------------------------------------------

    async def _group(self, lease: P.Lease, item: P.PromptItem) -> None:
        try:
            prompt_ids = self._encode(item.prompt)
            if not prompt_ids:
                raise ValueError("the prompt is empty after tokenising")
            outs = await self.engine.generate(prompt_ids, self.welcome.group_size, lease.sampling)
            # decode, score and encode off the event loop, which keeps feeding the engine meanwhile
            data = await asyncio.to_thread(self._rollout_message, lease, item, prompt_ids, outs)
            self.tokens += sum(len(o.token_ids) for o in outs)
            await self.push.send(data, copy=False)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            rejected = _prompt_at_fault(e)
            log.log(logging.WARNING if rejected else logging.ERROR, "group for prompt %d failed (%s: %s); %s",
                    item.prompt_id, type(e).__name__, e, "the prompt is rejected" if rejected else "leased again",
                    exc_info=not rejected)
            try:
                await self.client.request(P.GroupFailed(self.id, lease.lease_id, item.epoch, item.prompt_id,
                                                        f"{type(e).__name__}: {e}"[:1000], retry=not rejected))
            except P.PeerLost:  # the hub re-queues the lease when it drops this generator
                pass

    def _rollout_message(self, lease: P.Lease, item: P.PromptItem, prompt_ids: list[int], outs) -> bytes:
        texts = [self.tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        totals, per_fn = score(self.rewards, item.prompt, texts, [o.token_ids for o in outs], item.columns)
        samples = [
            P.Sample(P.pack_ints(o.token_ids), P.pack_floats(o.logprobs), totals[i], per_fn[i], o.finish_reason,
                     o.first_version, o.last_version, o.gen_ms)
            for i, o in enumerate(outs)
        ]
        return P.encode(P.RolloutGroup(lease.lease_id, self.id, item.prompt_id, item.epoch, P.pack_ints(prompt_ids),
                                       samples, float(lease.sampling["temperature"])))

    def _encode(self, prompt: str) -> list[int]:
        d = self.cfg.data
        if d.chat_template:
            messages = ([{"role": "system", "content": d.system_prompt}] if d.system_prompt else [])
            messages.append({"role": "user", "content": prompt})
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return self.tok(prompt, add_special_tokens=False)["input_ids"]


def _host_of(address: str) -> str:
    """tcp://HOST:PORT -> HOST"""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


async def main(cfg: Config, address: str, gpus: str = "") -> None:
    from transformers import AutoTokenizer

    from generator.engine import Engine
    from pipeline.tinymodel import resolve_model_path

    model_path = resolve_model_path(cfg.model.path)
    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path)
    engine = Engine(cfg, model_path, cfg.generator.seed + os.getpid() % 1000, tok.eos_token_id)
    gen = Generator(cfg, engine, tok, address, gpus)
    try:
        await gen.run()
    finally:
        with contextlib.suppress(Exception):
            engine.shutdown()


def _prompt_at_fault(e: Exception) -> bool:
    """vLLM refused the request itself (an empty prompt, one longer than max_model_len: VLLMClientError,
    ValueError in older releases): leasing the prompt again would fail the same way."""
    return isinstance(e, ValueError) or any(c.__name__ == "VLLMClientError" for c in type(e).__mro__)
