"""What `pipeline run`, `pipeline learner` and `pipeline generator` share: their arguments, and the config loaded,
checked and applied (`prepare`) before the heavy libraries are imported. A mistake `prepare` finds is refused with
exit code 2 (pipeline/entrypoints/cli.py); once it returns, the service has started and its errors are its own."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pipeline.config import Config, ConfigError, load_config
from pipeline.environment import apply_environment, env_flag


class Refused(Exception):
    """A service refused at start (its environment cannot be set): the message, exit code 2."""


def add_parser(sub, name: str, help: str, main) -> argparse.ArgumentParser:
    s = sub.add_parser(name, help=help)
    s.add_argument("-c", "--config", required=False, help="YAML config (default: the embedded demo)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. --set trainer.max_staleness=2 (repeatable)")
    s.add_argument("--gpus", default=None, help="GPUs this service may use, e.g. 2,3 (sets CUDA_VISIBLE_DEVICES)")
    s.set_defaults(main=main)
    return s


def add_run_dir(s: argparse.ArgumentParser) -> None:
    s.add_argument("--run-dir", type=Path, default=None, help="run directory (default: run.dir/run.name)")
    s.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR's run from its newest checkpoint (config: RUN_DIR/config.yaml unless -c)")


def launched() -> bool:
    """Started by torchrun (torch.distributed.elastic): it set RANK, LOCAL_RANK and WORLD_SIZE, not our spawner."""
    return bool(env_flag("TORCHELASTIC_RUN_ID"))


def prepare(args) -> tuple[Config, Path | None]:
    """The service's config, and for the learner and `run` its run directory, checked; the environment set."""
    from pipeline.launcher import check_run_dir, run_dir_of

    resume = getattr(args, "resume", None)
    # the run directory is checked by a lone learner, and under torchrun by rank 0 (`pipeline learner --gpus`
    # checks it before it starts its ranks, and their rank 0 finds it as it was)
    checks = not env_flag("RANK") or (launched() and env_flag("RANK") == "0")
    if resume is not None:
        if checks:
            check_run_dir(resume.resolve(), resume=True)
        if args.config is None:  # `--resume RUN_DIR`: the run's own config, --set on top
            args.config = str(resume / "config.yaml")
    if args.command == "learner" and args.config is None:
        raise ConfigError("pipeline learner: -c CONFIG is required (or --resume RUN_DIR: the run's config.yaml)")
    cfg = load_config(args.config, args.overrides)
    run_dir = None
    if args.command in ("learner", "run"):
        from learner.checkpoint import check_resume
        from learner.launch import world_size
        from pipeline.security import check_exposure

        check_exposure(cfg)
        if args.command == "run":
            from pipeline.mps import check_mps

            check_mps(cfg)  # run.mps where it would not act or cannot start: refused now, not once the learner is up
        if not env_flag("RANK"):  # more ranks than GPUs given is refused here, not in torch.cuda.set_device
            gpus = args.gpus or (cfg.run.learner_gpus if args.command == "run" else None)
            world_size(cfg.trainer.ranks, None if gpus is None else str(gpus))  # a str (RunConfig.__post_init__)
        if resume is not None and checks:  # another model or LoRA scale than the run's is refused at start
            for change in check_resume(cfg, resume.resolve()):
                print(f"pipeline {args.command}: resuming with {change} (RUN_DIR/config.yaml has the first)",
                      file=sys.stderr)
        if launched() and resume is None and args.run_dir is None and not cfg.run.name:
            from pipeline.launcher import RunDirError

            raise RunDirError("under torchrun every rank must name the same run directory: pass --run-dir DIR "
                              "(or set run.name), the same on every node")
        run_dir = run_dir_of(cfg, resume or args.run_dir)
        if resume is None and checks:
            check_run_dir(run_dir, resume=False)
    logging.basicConfig(level=cfg.run.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        apply_environment(cfg, args.gpus)
    except ConfigError as e:
        raise Refused(str(e)) from None
    from pipeline.mps import PIPE, under_mps

    if under_mps():  # run.mps's children, or services a user started under a daemon of theirs
        logging.getLogger("pipeline").info("CUDA MPS: a client of the daemon at %s=%s", PIPE, os.environ[PIPE])
    if args.command in ("learner", "run"):  # the learner pins what every generator runs: it must find it too
        from pipeline.pinning import content_digests

        content_digests(cfg)  # ConfigError, naming the field, where a module or file is not on this host
    args.started = True  # what goes wrong from here is the service's (cli.py refuses only what came before)
    return cfg, run_dir
