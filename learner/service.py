"""The learner service: the training loop, which reads like the algorithm.

    for step in version .. total_steps:
        groups = hub.take_batch(step)          # waits only when generation is behind
        stats  = train_step(engine, groups)    # GRPO loss with off-policy correction, one optimizer step
        publisher.publish(step + 1)            # the new weights version goes to every generator
        metrics, checkpoint
Rank 0 runs the hub (its own thread) and broadcasts each batch to the other ranks.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections import Counter
from pathlib import Path

import msgpack
import torch

from learner import checkpoint
from learner.hub import Hub, behaviour_version
from learner.model import build_engine, init_distributed, save_hf
from learner.publisher import WeightPublisher
from learner.step import train_step
from pipeline import protocol as P
from pipeline.config import Config, save_config
from pipeline.metrics import MetricsWriter, plot, truncate_metrics
from pipeline.tasks import load_rows
from pipeline.tinymodel import resolve_model_path
from pipeline.transports import remove_shm

log = logging.getLogger(__name__)


def main(cfg: Config, run_dir: Path, resume: bool = False) -> Path:
    rank, world = init_distributed()
    from transformers import AutoTokenizer

    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = build_engine(cfg, model_path)
    version, hub_state = checkpoint.load(engine, run_dir) if resume else (0, None)
    if resume and rank == 0:
        discarded = truncate_metrics(run_dir, version)
        log.info("resumed at version %d; %d step records after the checkpoint were discarded", version, discarded)
    run_id = f"{run_dir.name}-{secrets.token_hex(3)}"
    hub = collective = None
    if rank == 0:
        save_config(cfg, run_dir / "config.yaml")
        if cfg.weights.transport == "nccl" or (cfg.weights.transport == "auto" and torch.cuda.is_available()):
            from learner.collective import CollectivePeers

            collective = CollectivePeers(cfg.hub.host, cfg.weights.collective_timeout_s)
        hub = Hub(cfg, load_rows(cfg.data), run_dir, run_id, version, hub_state, collective)
        hub.start()
        (run_dir / "hub.json").write_text(json.dumps({"address": hub.address, "pid": os.getpid(), "run_id": run_id}))
        print(f"learner: hub listening on {hub.address}  (pipeline generator -c CONFIG --learner {hub.address})",
              flush=True)
    publisher = WeightPublisher(cfg, engine, hub, run_id, rank, collective)
    publisher.publish(version)
    metrics = MetricsWriter(run_dir)
    try:
        train(cfg, engine, hub, publisher, metrics, run_dir, version, rank, world, pad_id)
        publisher.flush()
        save_hf(engine, cfg, tokenizer, run_dir / "final", rank)
        if rank == 0:
            plot(run_dir)
            hub.wait_generators_gone(timeout=15.0)  # let generators hear "run complete" and leave
    finally:
        if hub is not None:
            hub.stop()
            remove_shm(run_id)
    return run_dir


def train(cfg, engine, hub, publisher, metrics, run_dir, version, rank, world, pad_id) -> None:
    last_tokens, last_time, start = (hub.counters["tokens"] if hub else 0), time.perf_counter(), time.perf_counter()
    for step in range(version, cfg.trainer.total_steps):
        t0 = time.perf_counter()
        groups, drop_stats = hub.take_batch(step) if rank == 0 else (None, {})
        groups = broadcast_groups(groups, rank, world, engine.device)
        waited = time.perf_counter() - t0
        stats = train_step(engine, groups, cfg, step, pad_id)
        step_end = time.time()
        trained_at = time.perf_counter()
        sync_ms = publisher.publish(step + 1, step_end)
        if rank != 0:
            continue
        now = time.perf_counter()
        tokens = hub.counters["tokens"]
        record = {
            "step": step, "version": step + 1, **stats, **drop_stats, "time/wait_s": waited,
            "time/step_s": trained_at - t0 - waited, "sync/weights_ms": sync_ms, "time/elapsed_s": now - start,
            "sync/serialize_ms": publisher.serialize_ms, "sync/broadcast_ms": publisher.broadcast_ms,
            "sync/copy_wait_ms": publisher.copy_wait_ms,
            "throughput/tokens_per_s": (tokens - last_tokens) / max(1e-6, now - last_time),
            "generators": len(hub.generators), "max_staleness": cfg.trainer.max_staleness,
            "trained": [[g.epoch, g.prompt_id, behaviour_version(g), g.generator_id] for g in groups],
            "groups_by_generator": dict(Counter(g.generator_id for g in groups)),
            **{f"hub/{k}": v for k, v in hub.counters.items()},
        }
        last_tokens, last_time = tokens, now
        metrics.write(record)
        every = cfg.trainer.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < cfg.trainer.total_steps:
            checkpoint.save(engine, run_dir, step + 1, hub.snapshot(), rank)
    checkpoint.save(engine, run_dir, cfg.trainer.total_steps, hub.snapshot() if hub else None, rank)


def broadcast_groups(groups, rank: int, world: int, device) -> list[P.RolloutGroup]:
    """Send rank 0's batch to every rank, encoded with the wire codec (no pickle)."""
    if world == 1:
        return groups
    import torch.distributed as dist

    if rank == 0:
        data = msgpack.packb([P.encode(g) for g in groups])
        size = torch.tensor([len(data)], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if rank == 0
           else torch.empty(int(size), dtype=torch.uint8, device=device))
    dist.broadcast(buf, 0)
    if rank == 0:
        return groups
    return [P.decode(b, limit=2**31)[0] for b in msgpack.unpackb(buf.cpu().numpy().tobytes())]
