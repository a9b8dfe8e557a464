"""The generator service: register with the hub, take leases, generate groups, push rollouts.

    spec     -> RunSpec (the run's config for what a generator serves: adopted, the engine built for it; again before
                each registration: a config its engine cannot serve builds the engine again; generator/spec.py)
    register -> Welcome (run id, version, transport, endpoints, session) -> a Session (generator/session.py): the
                registration's client, weights receiver, rollouts socket and what its tasks share
    tasks:   heartbeat   every heartbeat_s, listing every lease held; the reply lists leases the hub took back
             weights     WeightsReady, pushed by the hub on the control channel (the one route a version takes;
                         the current one right after the Welcome) -> fetch -> engine.load -> WeightsApplied
                         (generator/weights_loop.py)
             leases      LeaseRequest while there is room in the engine -> one task per prompt group (`group`); with
                         no room, one for none every heartbeat_s (RunComplete reaches a busy generator too)
                         (generator/leases.py)
             engine      watches the vLLM engine: a dead one ends the generator (below)
Nothing is generated before the engine holds weights of this run (the run id and version of the Welcome):
a generator that reconnects to a restarted learner, or to another run on the same port, loads them first.
A lost hub (no request sent and answered within the timeout) tears the session down and re-registers with
back-off under the same id, showing its last session; the engine stays warm. Each registration resets the
back-off; no answer for generator.hub_lost_s ends the generator (exit 1). The first SIGTERM/SIGINT drains: a
heartbeat tells the hub at once (an nccl generator takes no more broadcasts: its engine may be stopping too),
then finish groups, return the leases not started (nothing else is waited for), Leave, exit 0. A second one
leaves at once, whatever is still waited for. A dead engine leaves at once
with the engine's error (the hub re-queues the leases) and exits 1; so does a generator the hub refuses.
A reward function that raises is reported as an error of the run (GroupFailed kind "reward"). A generator that cannot
serve the run's config (what its own config says explicitly differs, the model files on its host differ or are not
there, its engine does not start) is refused, naming the field, and exits 1.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import zmq
import zmq.asyncio

from generator.leases import LeaseLoop
from generator.rollout import AgentFailed, Context, encode_group, score_group, seed_of
from generator.session import (
    MAX_LOAD_FAILURES,
    EngineDied,
    LeavingNow,
    LoadFailed,
    NotRegistered,
    Rebuild,
    Refused,
    Reregister,
    Session,
    ask,
)
from generator.spec import CannotServe, Spec
from generator.stages import Stages
from generator.weights_loop import WeightsLoop
from pipeline import protocol as P
from pipeline import trace
from pipeline.client import HubClient
from pipeline.config import Config
from pipeline.environment import held_gpus
from pipeline.host import host_identity, remove_receiver_dir, remove_stale
from pipeline.security import client_keys, secure_client
from pipeline.tasks import RewardError, encode_prompt
from weights import receiver

log = logging.getLogger(__name__)


MAX_REFUSALS = 12  # registrations refused in a row (about 75 s with back-off) before the generator gives up


class Generator:
    """The coordinator: a Session for each registration, in which it runs the lease loop (generator/leases.py), the
    weights loop (generator/weights_loop.py), the heartbeats and the engine's watch, and generates the groups the
    lease loop starts (`group`)."""

    def __init__(self, cfg: Config, engines, address: str, gpus: str = "", explicit: frozenset | set = frozenset()):
        """`cfg`: its own config, where and how it runs; what it serves comes from the run (generator/spec.py), and
        what `cfg` sets of that explicitly (`explicit`, dotted keys) it claims. `engines`:
        generator.engines.VllmEngines (or Fixed: an engine built elsewhere)."""
        self.address = address
        self.gpus = held_gpus(gpus)  # reported: `auto` picks ipc or nccl by them
        host, boot = host_identity()
        self.host, self.boot_id = host, boot
        self.id = f"gen-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.spec = Spec(cfg, engines, explicit, self.id)  # the run's config and the engine built for it
        self.keys = client_keys(cfg.auth.keys, cfg.auth.identity)
        self.ctx = zmq.asyncio.Context()
        self.stopping = 0  # 1: draining, 2: leave now
        self.refusals = 0  # registrations refused in a row
        self.load_failures = 0  # weights versions that failed to load in a row
        self.draining = asyncio.Event()  # a signal started the drain: the hub is told at once (no more broadcasts)
        self.leave_now = asyncio.Event()  # a second signal: stop waiting for anything, Leave, exit
        self.welcomed = False  # the current session registered
        self.session: Session | None = None  # the current registration's (generator/session.py)
        self.session_id = ""  # of the last registration: shown when registering again under the same id
        self.exit_code = 0
        self.tokens = 0
        self.started = time.monotonic()
        self.stages = Stages()  # where its time goes, reported in heartbeats (generator/stages.py)

    # what it serves: the run's config, its engine and tokenizer, its reward and rollout functions (generator/spec.py)
    cfg = property(lambda self: self.spec.cfg)
    engine = property(lambda self: self.spec.engine)
    tok = property(lambda self: self.spec.tok)
    rewards = property(lambda self: self.spec.rewards)
    rollout = property(lambda self: self.spec.rollout)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def run(self, handle_signals: bool = True) -> int:
        """Returns the exit code: 0 when it drained or the run completed, 1 when its engine died or the hub
        refused it."""
        try:
            return await self._run(handle_signals)
        finally:
            await self.spec.close()  # what the rollout strategy runs: an agent's endpoint

    async def _run(self, handle_signals: bool) -> int:
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, self._on_signal)
        backoff = 0.5
        reached = time.monotonic()  # when the hub last answered (none yet: now)
        while self.stopping < 2:
            self.welcomed = False
            try:
                await self._session()
                return self.exit_code
            except LeavingNow:
                return self.exit_code
            except Rebuild as e:
                log.info("generator %s: %s; its engine is built again", self.id, e)
                backoff = 0.5
                continue
            except (EngineDied, Refused, CannotServe, P.SchemaMismatch) as e:
                log.error("generator %s: %s", self.id, e)
                return 1
            except (P.PeerLost, Reregister, P.ProtocolError) as e:
                if self.stopping:  # draining, or the run is complete: nothing to come back for
                    return self.exit_code
                self.refusals = self.refusals + 1 if isinstance(e, NotRegistered) else 0
                if self.refusals >= MAX_REFUSALS:
                    log.error("generator %s: registration refused %d times in a row, the last: %s", self.id,
                              self.refusals, e)
                    return 1
                if isinstance(e, LoadFailed) and self.load_failures >= MAX_LOAD_FAILURES:
                    log.error("generator %s: %d weights loads failed in a row, the last: %s; giving up (the worker's "
                              "traceback is above in this log)", self.id, self.load_failures, e)
                    return 1
                if self.welcomed:  # a session that registered: this is a new incident, not the last one going on
                    backoff = 0.5
                reached = max(reached, self.client.last_reply)
                silent = time.monotonic() - reached
                if silent >= self.cfg.generator.hub_lost_s:  # the learner is gone for good (or the run ended unheard)
                    log.error("generator %s: no answer from the hub at %s for %.0f s (generator.hub_lost_s=%g), the "
                              "last error: %s; giving up", self.id, self.address, silent,
                              self.cfg.generator.hub_lost_s, e)
                    return 1
                log.warning("generator %s: %s; reconnecting in %.1f s (engine stays warm)", self.id, e, backoff)
                with contextlib.suppress(TimeoutError):  # a second signal ends the wait
                    await asyncio.wait_for(self.leave_now.wait(), min(backoff, self.cfg.generator.hub_lost_s - silent))
                backoff = min(backoff * 2, 10.0)
        return self.exit_code

    def _on_signal(self) -> None:
        self.stopping += 1
        self.draining.set()
        log.info("generator %s: %s", self.id, "draining (Ctrl-C again to leave now)" if self.stopping == 1 else
                 "leaving now")
        if self.stopping >= 2:  # whatever the session waits for (a version, nccl setup, groups) ends now: Leave
            self.leave_now.set()
            if self.session is not None:
                self.session.cancel_groups()

    async def _session(self) -> None:
        client = HubClient(self.address, timeout=max(10.0, 3 * self.cfg.hub.heartbeat_s), keys=self.keys)
        self.client = client
        session = None
        try:
            if why := await self._unless_leaving(self.spec.adopt(self._ask)):
                raise NotRegistered(f"the run's spec refused: {why}")
            welcome = await self._unless_leaving(self._ask(P.Register(
                self.id, self.host, self.boot_id, self.gpus, os.getpid(), self.engine.version,
                self.cfg.generator.tensor_parallel_size, self.session_id, self.engine.run_id,
                self.spec.digest, self.spec.fingerprints, self.spec.adapter_slots, self.spec.contents), timeout=10.0))
            if not isinstance(welcome, P.Welcome):
                raise NotRegistered(f"registration refused: {getattr(welcome, 'message', welcome)}")
            self.refusals, self.welcomed = 0, True
            log.info("generator %s registered (run %s, learner version %d, transport %s)", self.id, welcome.run_id,
                     welcome.version, welcome.transport)
            self.session_id = welcome.session
            session = self.session = Session(client, welcome, receiver(welcome.transport, client,
                                                                       self.cfg.weights.chunk_mb, self.id),
                                             self._rollouts_socket(welcome), self.engine)
            try:
                try:  # nccl: meet the learner in this generator's process group; a drain has no use for it
                    await self._unless_leaving(session.receiver.start(self.engine, _host_of(self.address), welcome),
                                               self.draining)
                except LeavingNow:
                    raise
                except Exception as e:  # the hub hears of it at re-registration (auto: a file transport then)
                    session.raise_if_dead(e)
                    raise Reregister(f"weights transport {welcome.transport} not started: {e}") from e
                await self._unless_leaving(self._run_tasks(session))
            except LeavingNow:  # a second signal (or a drain before any lease): Leave now; the hub re-queues the leases
                pass
            except Rebuild:  # its leases go back to the queue; the engine is built again before it registers again
                with contextlib.suppress(P.PeerLost):
                    await client.request(P.Leave(self.id, sorted(session.held), pushed=session.pushed), timeout=5.0)
                raise
            except EngineDied as e:  # leave at once: the hub re-queues the leases and records why
                with contextlib.suppress(P.PeerLost):
                    await client.request(P.Leave(self.id, sorted(session.held), str(e)[:16000], session.pushed),
                                         timeout=5.0)
                raise
            await client.request(P.Leave(self.id, sorted(session.held), pushed=session.pushed), timeout=5.0)
            log.info("generator %s left", self.id)
        finally:
            if session is not None:  # its groups, its receiver's hold (nccl's staging) and its socket end with it
                session.close()
            self.session = None
            client.close()

    def _rollouts_socket(self, welcome: P.Welcome) -> zmq.asyncio.Socket:
        """A PUSH socket connected to the hub's rollouts endpoint."""
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1000)
        push.setsockopt(zmq.LINGER, 5000)  # ms: flush queued rollouts on the way out
        secure_client(push, self.keys)
        push.connect(_on_host_of(welcome.rollouts_endpoint, self.address))
        return push

    async def _unless_leaving(self, aw, until: asyncio.Event | None = None):
        """Await `aw`, unless `until` is set first (default leave_now: a second signal): then it is cancelled and
        LeavingNow raised, so that leaving waits for nothing (nccl setup, a version, groups in flight)."""
        task = asyncio.ensure_future(aw)
        leaving = asyncio.create_task((until or self.leave_now).wait())
        try:
            await asyncio.wait([task, leaving], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            leaving.cancel()
        if not task.done():  # the second signal came first
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise LeavingNow()
        return task.result()

    async def _ask(self, msg: P.Message, timeout: float | None = None) -> P.Message:
        """Before the Welcome: generator/session.py's `ask` on this registration's client."""
        return await ask(self.client, msg, timeout)

    async def _run_tasks(self, session: Session) -> None:
        """Run until the lease loop ends (drained or run complete); a failing background task ends it too."""
        leases = asyncio.create_task(LeaseLoop(self, session).run())
        weights = WeightsLoop(self, session)
        tasks = [leases] + [asyncio.create_task(c) for c in (self._heartbeats(session), weights.run(),
                                                              weights.announcements(), self._watch_engine(session))]
        if trace.on():
            tasks.append(asyncio.create_task(self.stages.loop_lag()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # surfaces PeerLost / Reregister
                if t is not leases:
                    raise RuntimeError(f"background task {getattr(t.get_coro(), '__qualname__', t.get_name())} ended "
                                       "unexpectedly")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- background tasks -----------------------------------------------------------------------

    async def _heartbeats(self, session: Session) -> None:
        while True:
            draining = self.draining.is_set()
            reply = await session.ask(P.Heartbeat(
                self.id, session.engine.version if session.holds(0) else -1,
                self.tokens / max(1e-6, time.monotonic() - self.started), len(session.groups), sorted(session.held),
                draining, session.pushed,
                # progress, which the hub watches (a count that stops moving while it holds leases: a hung engine)
                self.tokens + session.engine.tokens_in_flight(), self.stages.report()))
            if isinstance(reply, P.Error):
                log.warning("heartbeat: %s", reply.message)
            elif isinstance(reply, P.HeartbeatReply):
                if why := self.spec.follow_staleness(reply.max_staleness):
                    raise Rebuild(why)
                dead = set(reply.dead_leases)
                for lease_id in dead:
                    session.held.pop(lease_id, None)
                for t, lease_id in list(session.groups.items()):
                    if lease_id in dead:
                        t.cancel()
                if dead:  # a lease that waits for its weights is not waited for any more
                    await session.version_changes()
            if draining:
                await asyncio.sleep(session.welcome.heartbeat_s)
            else:  # a drain is reported at once
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.draining.wait(), session.welcome.heartbeat_s)

    async def _watch_engine(self, session: Session) -> None:
        """A dead vLLM engine (its core process crashed or was killed) ends the generator within seconds, idle
        or not: every group would fail."""
        while not session.engine_dead():
            await asyncio.sleep(1.0)
        raise EngineDied(session.engine_error())

    # ---- one prompt group -----------------------------------------------------------------------

    async def group(self, session: Session, lease: P.Lease, item: P.PromptItem) -> None:
        """One prompt group of `lease`: generated, scored and sent to the hub, or reported as failed."""
        with self.stages.lane() as lane:  # its track of the timeline
            await self._generate(session, lease, item, lane)

    async def _generate(self, session: Session, lease: P.Lease, item: P.PromptItem, lane: str) -> None:
        task = asyncio.current_task()  # the group's own: `Session.stop_stale` cancels it by this
        try:
            prompt_ids = (P.unpack_ints(item.prompt_ids).tolist() if item.prompt_ids
                          else encode_prompt(self.tok, self.cfg.data, item.messages or item.prompt))
            if not prompt_ids:
                raise ValueError("the prompt is empty after tokenising")
            ctx = Context(lease.group_size or session.welcome.group_size, lease.sampling, self.tok, item,
                          seed_of(self.cfg.sampling.seed, item.epoch, item.prompt_id))
            self.stages.rollouts(+1)
            if not lease.eval and task is not None:  # an evaluation round's groups are never stale
                session.generating.add(task)
            try:
                with trace.span("generate", lane, prompt=item.prompt_id) as span:
                    outs = await self.rollout(session.engine, prompt_ids, ctx)  # generator/rollout.py
                    span["tokens"] = sum(len(o.token_ids) for o in outs)
            finally:
                self.stages.rollouts(-1)
                session.generating.discard(task)
            # score and encode off the event loop, which keeps feeding the engine meanwhile
            data, stamps = await asyncio.to_thread(self._score_and_encode, outs, ctx, lease, prompt_ids,
                                                   session.welcome.session)
            for name, start, end in stamps:
                self.stages.add(name, start, end, lane)
            self.tokens += sum(sum(o.mask) for o in outs)
            with self.stages.span("send", lane):
                await session.push.send(data, copy=False)
            session.pushed += 1
        except asyncio.CancelledError:
            if task is None or task not in session.stale:
                raise
            session.stale.discard(task)  # stopped by `Session.stop_stale`: the hub leases the prompt again
            task.uncancel()
            await self._report(session, lease, item, "stale", f"its samples started under version "
                               f"{session.engine.started_under(task)}, more than trainer.max_staleness="
                               f"{self.cfg.trainer.max_staleness} versions before version {session.engine.version}")
        except AgentFailed as e:  # generator.agent_failure requeue: the prompt is leased again
            await self._report(session, lease, item, "agent", str(e))
        except RewardError as e:  # the user's function: an error of the run, reported with its traceback
            log.error("group for prompt %d: %s", item.prompt_id, e)
            await self._report(session, lease, item, "reward", str(e))
        except Exception as e:
            if session.engine_dead():
                return  # _watch_engine ends the session and leaves; the hub re-queues the lease
            kind = "prompt" if _prompt_at_fault(e) else "engine"
            log.log(logging.WARNING if kind == "prompt" else logging.ERROR, "group for prompt %d failed (%s: %s); "
                    "reported to the hub (%s)", item.prompt_id, type(e).__name__, e, kind, exc_info=kind == "engine")
            await self._report(session, lease, item, kind, f"{type(e).__name__}: {e}")

    def _score_and_encode(self, outs, ctx: Context, lease: P.Lease, prompt_ids: list[int], session_id: str):
        """In a thread: the group's rewards and its RolloutGroup message, with when each began and ended."""
        t0 = time.time()
        scores = score_group(outs, ctx, self.rewards, self.cfg.trainer.total_steps)
        t1 = time.time()
        data = encode_group(outs, ctx, lease, prompt_ids, scores, self.id, session_id)
        return data, [("score", t0, t1), ("encode", t1, time.time())]

    async def _report(self, session: Session, lease: P.Lease, item: P.PromptItem, kind: str, reason: str) -> None:
        try:
            await session.client.request(P.GroupFailed(self.id, lease.lease_id, item.epoch, item.prompt_id,
                                                       reason[:16000], kind))
        except P.PeerLost:  # the hub re-queues the lease when it drops this generator
            pass


def _host_of(address: str) -> str:
    """tcp://HOST:PORT -> HOST"""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def _on_host_of(endpoint: str, address: str) -> str:
    """The hub's `endpoint` at the host this generator reached the hub by: a hub bound to 0.0.0.0 names its
    rollouts socket on 127.0.0.1, which a generator on another host must not take literally."""
    return f"{address.rsplit(':', 1)[0]}:{endpoint.rsplit(':', 1)[1]}"


async def main(cfg: Config, address: str, gpus: str = "", explicit: set[str] | frozenset = frozenset(),
               profile: Path | None = None, held: bool = False, build_first: bool = False) -> int:
    """`cfg`: this generator's own config; `explicit`: the dotted keys its file and --set gave (what it claims);
    `profile`: write its timeline there (pipeline/trace.py); `held`: once vLLM is imported, wait for a line on stdin
    before anything else (`--go-on-stdin`: `pipeline run` tells generators sharing a GPU when to build their engine);
    `build_first`: build the engine `cfg` names before asking the hub (`--build-first`)."""
    from generator.engines import VllmEngines

    # as in the engine core's process (generator/worker_ext.py): finalization's full collections would walk every
    # object of vLLM and torch again, 1.7 s of a generator's exit on 2 cores; atexit handlers and finalizers still run
    atexit.register(gc.freeze)
    if profile is not None:
        trace.start(profile, "generator")

    for stale in remove_stale():  # what a process killed with SIGKILL left in /dev/shm and the temp folder
        log.info("removed %s, left by a process that no longer runs", stale)
    engines = VllmEngines()
    engines.warm()  # vLLM's imports first: a learner started with this generator brings its hub up meanwhile
    if held:
        start = time.monotonic()
        with trace.span("held", "engine"):
            told = await asyncio.to_thread(sys.stdin.readline)
        if not told:
            log.error("generator: its launcher ended before telling it to go on (--go-on-stdin); leaving")
            return 1
        log.info("generator: vLLM imported, held %.1f s until the hub was up and the generators before it on its GPU "
                 "had registered", time.monotonic() - start)
    try:
        generator = Generator(cfg, engines, address, gpus, explicit)
        if build_first:
            await generator.spec.prebuild("built first (--build-first): from its own config while the hub starts")
        return await generator.run()
    finally:
        with contextlib.suppress(Exception):
            engines.close()
        remove_receiver_dir()


def _prompt_at_fault(e: Exception) -> bool:
    """vLLM refused the request itself (VLLMClientError: e.g. a prompt longer than max_model_len, which the hub
    checks first): leasing the prompt to the same engine again would fail the same way. Any other error,
    a ValueError of ours included, is the engine's."""
    return any(c.__name__ == "VLLMClientError" for c in type(e).__mro__)
