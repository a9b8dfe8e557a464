"""The learner service: the training loop (`Learner`), which reads like the algorithm.

    for step in version .. total_steps:
        groups = hub.take_batch(step)          # waits only when generation is behind
        stats  = train_step(engine, extras, groups)  # GRPO loss with off-policy correction, one optimizer step
        if the step was not finite: its prompts are leased again, nothing is published (stop after N in a row)
        publisher.publish(step + 1)            # the new weights version goes to every generator
        hub.finish_step(step + 1)              # its groups are trained: admission moves on
        metrics, checkpoint (every rank: ZeRO's save is collective)
Rank 0 runs the hub (its own thread) and broadcasts each batch, with the run-time knobs (`pipeline set`),
to the other ranks, over the ranks' gloo group on the CPU (learner/model.py `control_group`). The run ends after
total_steps, or early when the dataset is exhausted (trainer.epochs).
SIGTERM ends it like Ctrl-C: the hub stops and the shared-memory files are removed.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

import weights
from hub.hub import DatasetExhausted, Hub
from hub.trainer import TrainerHub
from learner import checkpoint
from learner.early import POLL_S, early_proximal
from learner.model import Extras, build_engine, control_group, init_distributed, leave_distributed
from learner.publisher import WeightPublisher
from learner.ranks import Roster
from learner.signal import Signal
from learner.step import token_budget, train_step, warm_up
from learner.timeline import StepTimes
from learner.versions import version_kind
from pipeline import protocol as P
from pipeline import trace
from pipeline.config import Config, ConfigError, save_config
from pipeline.environment import held_at_step, slowed_step_s
from pipeline.fingerprint import of_model
from pipeline.host import remove_stale
from pipeline.metrics import MetricsWriter, plot, read_jsonl, read_metrics, step_record, truncate_metrics
from pipeline.mps import under_mps
from pipeline.pinning import content_digests
from pipeline.runtime_knobs import apply_runtime_change
from pipeline.tasks import encode_prompt, load_eval_rows, load_rows
from pipeline.tinymodel import resolve_model_path
from pipeline.verdict import Verdicts, timed, verdict
from weights.base import Sender
from weights.files import remove_shm

log = logging.getLogger(__name__)
KEEPALIVE_S = 5.0  # rank 0, waiting for a batch, tells the other ranks this often that it is there
STUCK_S = 10.0  # a rank still running this long after SIGTERM or SIGINT is stuck in a collective (`end_if_stuck`)


class NotFinite(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient."""


def main(cfg: Config, run_dir: Path, resume: bool = False, token: str = "", profile: bool = False) -> Path:
    """`token`: `pipeline run`'s, written in hub.json so that it takes this learner's address and no other.
    `profile`: the timeline of each rank (and of its hub) goes to RUN_DIR/trace/, merged into RUN_DIR/trace.json."""
    stop_on_signals()
    model_path = resolve_model_path(cfg.model.path)  # before the process group: a builtin model is built (once per
    # machine) by whichever rank comes first, and transformers saves nothing on a rank other than 0 of a group
    place = Place.join(cfg, run_dir, profile)
    try:
        learner = Learner.build(cfg, model_path, place, resume, token)
        with place.explains():  # a collective that failed: was a rank lost?
            learner.run()
        learner.finish()
    finally:
        place.close()
    leave_distributed()  # the run ended well on this rank (an error has left above)
    return run_dir


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end the run like Ctrl-C: finally blocks run, the hub stops, shm files are removed."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    # a rank that aborts in C++ prints every thread's Python stack: a finished rank 1 once more aborted at its end
    # ("terminate called without an active exception", test_chaos's resumed 2-rank learner, 2026-11-29)
    faulthandler.enable()


@dataclass
class Place:
    """This rank among the learner's ranks, and what it closes however the run ends: rank 0's hub once started
    (`hub`, set by `Learner.build`), the roster of ranks (several ranks: it tells a lost rank from a failed
    collective), the timeline (`--profile`). `control`: the ranks' CPU group for rank 0's messages
    (learner/model.py `control_group`)."""

    rank: int
    world: int
    run_id: str
    run_dir: Path
    profile: bool = False
    roster: Roster | None = None
    hub: Hub | None = None
    control: Any = None

    @classmethod
    def join(cls, cfg: Config, run_dir: Path, profile: bool) -> Place:
        rank, world = init_distributed(cfg.trainer.rank_timeout_s)
        if profile:
            trace.start(trace.trace_dir(run_dir), f"learner-rank{rank}")
        place = cls(rank, world, f"{run_dir.name}-{secrets.token_hex(3)}", run_dir, profile)
        place.control = control_group(world, cfg.trainer.rank_timeout_s)
        if world > 1:
            place.roster = Roster(rank, world)
            end_if_stuck(place.run_id)
        log.info("learner rank %d of %d on host %s (local rank %s)", rank, world, socket.gethostname(),
                 os.environ.get("LOCAL_RANK", "0"))
        return place

    @contextmanager
    def explains(self) -> Iterator[None]:
        """A collective that failed (gloo, nccl: RuntimeError), or torchrun's agent stopping this rank (its
        rendezvous lost a node), raised as the rank that was lost when one was."""
        try:
            yield
        except (RuntimeError, KeyboardInterrupt) as e:
            lost = self.roster.explain(e, linger=isinstance(e, RuntimeError)) if self.roster is not None else None
            if lost is None:
                raise
            raise lost from e

    def close(self) -> None:
        if self.hub is not None:
            self.hub.stop()
            remove_shm(self.run_id)
        if self.profile and self.rank == 0:  # what every process wrote so far; `pipeline run` merges again at the end
            trace.TRACE.flush()
            trace.merge(self.run_dir)
        if self.roster is not None:
            self.roster.close()


def start_hub(cfg: Config, place: Place, version: int, hub_state: dict | None, tokenizer, engine,
              kind: str, token: str) -> tuple[Hub, dict[str, Sender], dict]:
    """Rank 0's hub, started, its address in RUN_DIR/hub.json: (the hub, the weight senders by transport, what a
    checkpoint's weights mean). The senders are the learner's: its publisher drives them, the hub tells them who
    joins; they ask the hub to announce."""
    run_dir = place.run_dir
    for stale in remove_stale():
        log.info("removed %s, left by a process that no longer runs", stale)
    save_config(cfg, run_dir / "config.yaml")
    with trace.span("start the hub", "startup"):  # the model's fingerprints, the dataset, the sockets
        # what every generator's files must be, and what a checkpoint's weights mean
        prints, contents = of_model(cfg.model), content_digests(cfg)
        what = checkpoint.meaning(cfg, prints["model.path"], kind, contents)
        hub = place.hub = Hub(cfg, load_rows(cfg.data), run_dir, place.run_id, version, hub_state,
                              encode=lambda text: encode_prompt(tokenizer, cfg.data, text),
                              vocab_size=engine.module.config.vocab_size, eval_rows=load_eval_rows(cfg),
                              fingerprints=prints, contents=contents)
        senders = weights.senders(cfg, hub, place.run_id)
        hub.serve_weights(senders)
        hub.start()
    _write_hub_json(run_dir, {"address": hub.address, "pid": os.getpid(), "run_id": place.run_id,
                              "rollouts": hub.rollouts_address, "token": token})
    print(f"learner: hub listening on {hub.address}  (pipeline generator --learner {hub.address})", flush=True)
    return hub, senders, what


def _terminate(signum, frame) -> None:
    # once: the clean-up the first signal starts (the hub's sockets, the /dev/shm files) must not be cut short by
    # the next (a rank gets SIGTERM from its group and from its parent; a second Ctrl-C)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def end_if_stuck(run_id: str, grace_s: float = STUCK_S) -> None:
    """A signal that cannot stop the rank: its main thread waits in a collective for a rank that is gone (nccl does
    not see a dead peer on its host until trainer.rank_timeout_s), where Python's handler (`_terminate`) runs only
    once the call returns, and torchrun's agent SIGKILLs it 30 s on, before its files are removed. A thread hears
    the signal at once (the wakeup fd); if the process still runs `grace_s` later, it removes the run's /dev/shm
    files itself and exits 130."""
    heard, tell = socket.socketpair()
    tell.setblocking(False)
    signal.set_wakeup_fd(tell.fileno())

    def watch() -> None:
        with heard, tell:  # both live as long as this thread: the wakeup fd must never name a closed descriptor
            while (sig := heard.recv(1)) and sig[0] not in (signal.SIGTERM, signal.SIGINT):
                pass  # the byte is the signal's number; others with a Python handler come this way too
            if not sig:
                return
            time.sleep(grace_s)
            log.error("the learner did not stop within %.0f s of the signal (it waits in a collective for a rank "
                      "that is gone); its /dev/shm files are removed and it exits", grace_s)
            remove_shm(run_id)
            os._exit(130)

    threading.Thread(target=watch, name="end-if-stuck", daemon=True).start()


def _write_hub_json(run_dir: Path, hub: dict) -> None:
    """RUN_DIR/hub.json, whole or not at all: a launcher polling for it never reads half of it."""
    tmp = run_dir / "hub.json.tmp"
    tmp.write_text(json.dumps(hub))
    os.replace(tmp, run_dir / "hub.json")


class Learner:
    """One rank's trainer, its parts as attributes (`build` makes them): `run` trains from the version it was built
    at to trainer.total_steps (or until the dataset is exhausted), `step` is one step as the algorithm reads. Each
    step's phases are timed (learner/timeline.py): its record says where its time went, and a profiled run's trace
    shows it; every few steps and at the end, rank 0 says what holds the run back (pipeline/verdict.py). `extras`:
    build_engine's, beside the engine; `what`: what the weights mean, recorded with each checkpoint."""

    def __init__(self, cfg: Config, engine, extras: Extras, *, hub: TrainerHub | None, publisher: WeightPublisher,
                 metrics: MetricsWriter | None, run_dir: Path, rank: int = 0, world: int = 1, pad_id: int = 0,
                 what: dict | None = None, version: int = 0, tokenizer=None, control: Any = None):
        self.cfg, self.engine, self.extras, self.hub, self.publisher = cfg, engine, extras, hub, publisher
        self.metrics, self.run_dir, self.rank, self.world = metrics, run_dir, rank, world
        self.control = control  # the ranks' CPU group for rank 0's messages (Place.control)
        self.pad_id, self.what, self.version, self.tokenizer = pad_id, what, version, tokenizer
        seen = hub.step_stats() if hub is not None else None
        self.times = StepTimes(seen)
        self.skipped = 0  # steps not finite in a row
        self.started = self.last_time = time.perf_counter()
        self.last_tokens = seen.tokens if seen is not None else 0
        self.verdicts = Verdicts(lora=cfg.model.lora is not None)
        self.signal = Signal()  # whether the steps still teach anything (learner/signal.py)
        self.slowed_s = slowed_step_s()  # tests only: a learner slower than its compute (pipeline/environment.py)
        self.held_at, self.release = held_at_step()  # tests only: a run held at a known step
        self.early = early_proximal(engine, cfg, pad_id)  # every rank: they share its forward
        self.early_budget = (-1, 0)  # (step, its micro-batch token budget), asked once a wait (a collective)

    @classmethod
    def build(cls, cfg: Config, model_path: str, place: Place, resume: bool = False, token: str = "") -> Learner:
        """This rank's parts, in order: the tokenizer, the engine (at the newest checkpoint's version when resumed),
        rank 0's hub (`place.hub`) with the weight senders it shares with the publisher, the publisher with the first
        version published, rank 0's metrics."""
        run_dir, rank = place.run_dir, place.rank
        if rank == 0:  # a resumed run's: its learner is gone, and nobody may take its address for this one's
            (run_dir / "hub.json").unlink(missing_ok=True)
        from transformers import AutoTokenizer

        with trace.span("tokenizer", "startup"):  # the learner's start, on a track of its own (--profile)
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if resume:
            reapply_changes(cfg, run_dir)
        with trace.span("build engine", "startup"):
            engine, extras = build_engine(cfg, model_path)
        kind = version_kind(cfg, engine.module).kind  # a checkpoint of the other kind is refused
        version, hub_state = checkpoint.load(engine, run_dir, kind) if resume else (0, None)
        if resume and rank == 0:
            discarded = truncate_metrics(run_dir, version)
            log.info("resumed at version %d; %d step records after the checkpoint were discarded", version, discarded)
        hub, senders, what = start_hub(cfg, place, version, hub_state, tokenizer, engine, kind, token) \
            if rank == 0 else (None, {}, None)
        publisher = WeightPublisher(cfg, engine, senders.values(), rank)
        with trace.span("publish the first version", "startup"):
            publisher.publish(version)
        with trace.span("compile the step", "startup"):  # trainer.compile: while the first batch is generated
            began = time.perf_counter()
            if warm_up(engine, cfg, pad_id):
                log.info("trainer.compile: the step's graphs compiled in %.1f s, while the first batch was generated",
                         time.perf_counter() - began)
        metrics = MetricsWriter(run_dir, cfg.run.tensorboard, cfg.run.wandb_project) if rank == 0 else None
        return cls(cfg, engine, extras, hub=hub, publisher=publisher, metrics=metrics, run_dir=run_dir, rank=rank,
                   world=place.world, pad_id=pad_id, what=what, version=version, tokenizer=tokenizer,
                   control=place.control)

    def run(self) -> int:
        """Train from the version built at; then the final checkpoint, the last weights sent and the final model
        saved (full, or the adapter). Returns the last version."""
        step = self.version
        while step < self.cfg.trainer.total_steps:
            made = self.step(step)
            if made is None:  # the run ends early
                break
            step = made
            while step == self.held_at and not (self.release and os.path.exists(self.release)):  # tests only
                time.sleep(0.1)
        with trace.span("final checkpoint", "learner"):
            self.save(step)
        if self.hub is not None:
            self.conclude(self.hub)
        if self.metrics is not None:
            self.metrics.close()
        self.publisher.flush()
        self.publisher.kind.save_final(self.engine, self.cfg, self.tokenizer, self.run_dir / "final", self.rank)
        return step

    def finish(self) -> None:
        """Rank 0, after the run: the last version's evaluation (eval.jsonl, a while at most), the reward plot, and
        "run complete" to the generators, with time to hear it and leave."""
        if self.hub is None:
            return
        if self.cfg.eval.every:
            self.hub.evaluations(wait_s=self.cfg.hub.lease_timeout_s)
        plot(self.run_dir)
        self.hub.finish_run()
        self.hub.wait_generators_gone(timeout=15.0)

    def step(self, step: int) -> int | None:
        """The step from version `step`: the version it made (`step` again when it was not finite), None when the run
        ends early."""
        idle = (lambda: self.ahead(step)) if self.early is not None else None
        with self.times.phase("wait"):
            groups, drop_stats, knobs, end = next_batch(self.hub, step, self.cfg, self.rank, self.world,
                                                        self.control, idle)
        if end:
            log.warning("%s", end)
            return None
        assert groups is not None  # next_batch returns none only with `end`
        with self.times.phase("train"):
            stats = train_step(self.engine, self.extras, groups, self.cfg, step, self.pad_id, knobs, self.early)
            if self.slowed_s:
                time.sleep(self.slowed_s)
        if stats["skipped"]:
            self.skipped += 1
            self.times.end(step, skipped=True)
            _skipped(self.hub, step, stats, len(groups), self.skipped, self.cfg.trainer.max_skipped_steps)
            return step
        self.skipped = 0
        with self.times.phase("publish"):
            sync_ms = self.publisher.publish(step + 1, time.time())
            if self.hub is not None:
                self.hub.finish_step(step + 1)  # its groups are trained; admission moves on
        if self.hub is not None:  # rank 0: the step's record before its checkpoint (a crash between loses no record)
            with self.times.phase("record"):
                self.record(self.hub, step, {**stats, **drop_stats}, knobs, groups, sync_ms)
        every, total = self.cfg.trainer.checkpoint_every, self.cfg.trainer.total_steps
        if every and (step + 1) % every == 0 and step + 1 < total:
            with self.times.phase("checkpoint"):
                self.save(step + 1)
        self.times.end(step)
        return step + 1

    def ahead(self, step: int) -> bool:
        """While the learner waits for its batch: a micro-batch of the proximal log-probs of the groups it will take
        first, when there is one to compute (learner/early.py). Its time is the step's `early` phase, inside `wait`."""
        assert self.early is not None
        with self.times.phase("early"):
            if self.early_budget[0] != step:  # every rank's first look of the step: the collectives line up
                self.early_budget = (step, token_budget(self.engine, self.cfg.trainer.micro_batch_tokens,
                                                        self.extras.bytes_per_token))
            budget = self.early_budget[1]
            new, quiet = self.early.news(self.hub.ahead(step), step) if self.hub is not None else ([], False)
            if self.world > 1:
                new, quiet = share_news(new, quiet, self.rank, self.control)
            return self.early.take(new, quiet, step, budget)

    def record(self, hub: TrainerHub, step: int, stats: dict, knobs: dict, groups: list, sync_ms: float) -> None:
        now, seen = time.perf_counter(), hub.step_stats()
        rate = (seen.tokens - self.last_tokens) / max(1e-6, now - self.last_time)
        assert self.metrics is not None  # rank 0's
        record = step_record(
            step, {**stats, **self.times.record(seen)}, sync_ms=sync_ms, elapsed_s=now - self.started,
            publisher=self.publisher.metrics(), tokens_per_s=rate, generators=seen.generators,
            max_staleness=knobs["trainer.max_staleness"], groups=groups, counters=seen.counters,
            evaluations=hub.evaluations(), on_learner_gpus=seen.on_learner_gpus, mps=under_mps())
        # what holds the run back, from the records so far and this one, whole: read, never changed
        due = self.verdicts.add(record)
        if due is not None:
            record.update(due.fields())
        self.metrics.write(record)
        self.last_tokens, self.last_time = seen.tokens, now
        if due is not None:
            log.info("what holds the run back, %s", due.line())
            hub.set_verdict(due.line())
        if changed := self.verdicts.changed():  # generators joined, or k changed, `every` steps ago: did it pay?
            log.info("%s", changed)
        if gone := self.signal.add(record):
            log.warning("%s", gone)

    def conclude(self, hub: TrainerHub) -> None:
        """Rank 0, at the end: what held the whole run back (every step in metrics.jsonl, a resumed run's too)."""
        final = verdict(timed(read_metrics(self.run_dir)), self.verdicts.lora)
        if final is not None:
            log.info("what held the run back, %s", final.line())
            hub.set_verdict(final.line())

    def save(self, version: int) -> None:
        checkpoint.save(self.engine, self.run_dir, version, self.hub.snapshot() if self.hub else None, self.rank,
                        self.cfg.trainer.keep_checkpoints, self.what)


def next_batch(hub: TrainerHub | None, step: int, cfg: Config, rank: int, world: int, group: Any,
               idle: Callable[[], bool] | None = None) -> tuple[list | None, dict, dict, str]:
    """Rank 0's next batch, on every rank: (groups, counts of the groups gone stale and the wait for those about to,
    knobs, why the run ends). While
    rank 0 waits for rollouts it tells the others every KEEPALIVE_S, so that no rank waits in a collective longer
    than a step takes: a collective that waits trainer.rank_timeout_s means a rank is gone. `group`: the ranks' CPU
    group (learner/model.py `control_group`), so that the others wait on the CPU, not on their GPUs. `idle`: work
    every rank does while the batch is not complete, a little at a time (True: it did some), between rank 0's looks
    at the hub."""
    # dropped by the hub, stopped by their generators; how long the batch waited for groups whose last chance it was
    counts = {"staleness/dropped": 0, "staleness/stopped": 0, "staleness/last_chance_wait_s": 0.0}
    wait = 0.0 if idle is not None else KEEPALIVE_S if world > 1 else None
    while True:
        groups, stats, knobs, end = _take(hub, step, wait) if rank == 0 else (None, {}, {}, "")
        for key in counts:
            counts[key] += stats.get(key, 0)
        groups, knobs, end = broadcast_batch(groups, knobs, cfg, end, rank, world, group)
        if groups is not None or end:
            return groups, counts, knobs, end
        if idle is not None:
            wait = 0.0 if idle() else POLL_S  # look again at once after some work; else wait a while for groups


def _take(hub: TrainerHub | None, step: int,
          wait_s: float | None) -> tuple[list[P.RolloutGroup] | None, dict, dict, str]:
    assert hub is not None  # rank 0's
    try:
        groups, stats, knobs = hub.take_batch(step, wait_s)
    except DatasetExhausted as e:
        return None, {}, {}, str(e)
    return groups, stats, knobs, ""


def _skipped(hub: TrainerHub | None, step: int, stats: dict, n_groups: int, in_a_row: int, limit: int) -> None:
    """A step that was not finite: nothing changed, nothing is published; its prompts are leased again."""
    log.warning("step %d skipped: its loss (%s) or gradient (norm %s) is not finite; the weights stay at version "
                "%d, its %d groups are leased again (%d in a row, trainer.max_skipped_steps=%d)", step, stats["loss"],
                stats["grad_norm"], step, n_groups, in_a_row, limit)
    if hub is not None:
        hub.abandon_step()
    if in_a_row >= limit:
        raise NotFinite(f"{in_a_row} steps in a row had a non-finite loss or gradient (trainer.max_skipped_steps); "
                        f"the weights of version {step} were kept. Check trainer.lr, the rewards and the data")


def broadcast_batch(groups, knobs: dict, cfg: Config, end: str, rank: int, world: int, group: Any) -> tuple[
        list | None, dict, str]:
    """Send rank 0's batch to every rank, encoded with the wire codec (no pickle), with the run-time knobs it was
    built under (`pipeline set` reaches rank 0's hub, which read them once for the batch: every rank trains the step
    with that one snapshot) and why the run ends, if it does. `groups` None: no batch yet, rank 0 waits on."""
    if world == 1:
        return groups, knobs, end
    body = _from_rank0({"groups": None if groups is None else [P.encode(g) for g in groups], "knobs": knobs,
                        "end": end} if rank == 0 else None, rank, group)
    if rank == 0:
        return groups, knobs, end
    for key, value in body["knobs"].items():  # kept in this rank's config too (its checkpoints, its log)
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != value:
            apply_runtime_change(cfg, key, value)
            log.info("rank %d: %s = %r (run-time change, from rank 0)", rank, key, value)
    if body["groups"] is None:
        return None, body["knobs"], body["end"]
    return [P.decode(b, limits=P.FROM_HUB)[0] for b in body["groups"]], body["knobs"], body["end"]


def share_news(new: list[P.RolloutGroup], quiet: bool, rank: int, group: Any) -> tuple[list, bool]:
    """Rank 0's news of the groups it will take first (learner/early.py `EarlyProximal.news`), on every rank, encoded
    with the wire codec."""
    body = _from_rank0({"groups": [P.encode(g) for g in new], "quiet": quiet} if rank == 0 else None, rank, group)
    if rank == 0:
        return new, quiet
    return [P.decode(b, limits=P.FROM_HUB)[0] for b in body["groups"]], body["quiet"]


def _from_rank0(body: dict | None, rank: int, group: Any) -> dict:
    """Rank 0's `body` (msgpack) on every rank: two broadcasts over `group` (gloo: CPU tensors), its size and its
    bytes."""
    import torch.distributed as dist

    data = msgpack.packb(body) if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.long)
    dist.broadcast(size, 0, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0
           else torch.empty(int(size), dtype=torch.uint8))
    dist.broadcast(buf, 0, group=group)
    return body if rank == 0 and body is not None else msgpack.unpackb(buf.numpy().tobytes())


def reapply_changes(cfg: Config, run_dir: Path) -> None:
    """`--resume`: the run-time changes of RUN_DIR/changes.jsonl hold again, in order (the operator's last word
    on each knob, including changes made after the checkpoint the run resumes from)."""
    applied = {}
    for change in read_jsonl(run_dir / "changes.jsonl"):
        try:
            applied[change["key"]] = apply_runtime_change(cfg, change["key"], change["value"])
        except (ConfigError, KeyError) as e:
            log.warning("changes.jsonl: %s not re-applied (%s)", change, e)
    if applied:
        log.info("re-applied run-time changes from changes.jsonl: %s",
                 ", ".join(f"{k}={v!r}" for k, v in applied.items()))
