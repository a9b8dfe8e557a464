"""`pipeline learner`: the learner service (DeepSpeed, and the hub on rank 0). With more ranks than one and no
torchrun around it, it runs this host's ranks under torchrun's agent (learner/launch.py), each a `pipeline learner`."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from pipeline.config import ConfigError
from pipeline.entrypoints import service
from pipeline.environment import env_flag

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    s = service.add_parser(sub, "learner", "the learner service (DeepSpeed + hub)", main)
    service.add_run_dir(s)
    s.add_argument("--profile", action="store_true", help="write the learner's and hub's timeline to RUN_DIR/trace/, "
                   "merged into RUN_DIR/trace.json at the end (give generators --profile RUN_DIR/trace)")
    s.add_argument("--launch-token", default="", help=argparse.SUPPRESS)  # `pipeline run`'s, echoed in hub.json


def main(args: argparse.Namespace, argv: list[str] | None) -> int:
    cfg, run_dir = service.prepare(args)
    assert run_dir is not None  # prepare gives the learner its run directory
    from learner.launch import end_with_parent, run_ranks, world_size

    run_dir.mkdir(parents=True, exist_ok=True)
    world = world_size(cfg.trainer.ranks, args.gpus)
    if world > 1 and not env_flag("RANK"):  # this host's ranks, under torchrun's agent, same run directory
        child = sys.argv[1:] if argv is None else list(argv)
        if args.run_dir is None and args.resume is None:
            child += ["--run-dir", str(run_dir)]
        return run_ranks(child, world)
    parent = os.getppid()
    if service.launched():
        end_with_parent()
    from hub.hub import HubStopped
    from learner.checkpoint import CheckpointError
    from learner.ranks import RankLost
    from learner.service import NotFinite
    from learner.service import main as learner_main

    try:
        learner_main(cfg, run_dir, resume=args.resume is not None, token=args.launch_token, profile=args.profile)
    except (HubStopped, NotFinite, CheckpointError, RankLost, ConfigError) as e:  # cannot go on: why, no traceback
        log.error("the run failed: %s", e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (learner.service turns it into this)
        who = f" rank {env_flag('RANK')} on host {socket.gethostname()}" if service.launched() else ""
        orphan = " (its launcher, torchrun's agent, is gone)" if os.getppid() != parent else ""
        log.warning("learner%s stopped by a signal%s; the hub and its files are gone", who, orphan)
        return 130
    return 0
