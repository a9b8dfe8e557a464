"""`pipeline`: the command line. Each subcommand parses its config, sets the environment, imports
the heavy libraries late and hands over to its service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path

from pipeline.config import ConfigError, apply_environment, env_flag, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeline", description="Asynchronous pipelined RL for language models.")
    sub = p.add_subparsers(dest="command", required=True)

    def service(name: str, help: str, config_required: bool) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help)
        s.add_argument("-c", "--config", required=config_required, help="YAML config (default: the embedded demo)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, e.g. --set trainer.max_staleness=2 (repeatable)")
        s.add_argument("--gpus", default=None, help="GPUs this service may use, e.g. 2,3 (sets CUDA_VISIBLE_DEVICES)")
        return s

    run = service("run", "learner + generators on this machine (no config: the embedded default)", False)
    run.add_argument("--profile", action="store_true",
                     help="write RUN_DIR/trace.json: where every second of every process went (ui.perfetto.dev)")
    run.add_argument("--run-dir", type=Path, default=None, help="run directory (default: run.dir/run.name)")
    run.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                     help="continue RUN_DIR's run from its newest checkpoint (config: RUN_DIR/config.yaml unless -c)")
    lrn = service("learner", "the learner service (DeepSpeed + hub)", False)
    lrn.add_argument("--run-dir", type=Path, default=None, help="run directory (default: run.dir/run.name)")
    lrn.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                     help="continue RUN_DIR's run from its newest checkpoint (config: RUN_DIR/config.yaml unless -c)")
    lrn.add_argument("--profile", action="store_true", help="write the learner's and hub's timeline to RUN_DIR/trace/, "
                     "merged into RUN_DIR/trace.json at the end (give generators --profile RUN_DIR/trace)")
    lrn.add_argument("--launch-token", default="", help=argparse.SUPPRESS)  # `pipeline run`'s, echoed in hub.json
    gen = service("generator", "a generator service (vLLM): it serves the run's model and config, which it takes from "
                  "the learner; -c/--set say where and how it runs (GPUs, engine memory, keys)", False)
    gen.add_argument("--learner", required=True, help="hub address, e.g. tcp://127.0.0.1:5555")
    gen.add_argument("--profile", type=Path, default=None, metavar="DIR",
                     help="write this generator's timeline to DIR (the learner's RUN_DIR/trace on its host)")
    st = sub.add_parser("status", help="the learner's version, buffer and generators")
    st.add_argument("--watch", action="store_true")
    se = sub.add_parser("set", help="change run-time knobs of a running learner")
    se.add_argument("items", nargs="+", metavar="KEY=VALUE")
    for remote in (st, se):
        remote.add_argument("--learner", required=True)
        remote.add_argument("--keys", default=None, metavar="DIR", help="auth.keys of the learner (CURVE)")
        remote.add_argument("--identity", default="operator", help="operator key pair in --keys (DIR/NAME.key_secret)")
    ks = sub.add_parser("keys", help="make CURVE key pairs for auth.keys: the hub's, generators', operators'")
    ks.add_argument("dir", type=Path)
    ks.add_argument("--generator", action="append", default=[], metavar="NAME", help="add a generator key pair")
    ks.add_argument("--operator", action="append", default=[], metavar="NAME", help="add an operator key pair")
    return p


def launched() -> bool:
    """Started by torchrun (torch.distributed.elastic): it set RANK, LOCAL_RANK and WORLD_SIZE, not our spawner."""
    return bool(env_flag("TORCHELASTIC_RUN_ID"))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from learner.checkpoint import CheckpointError
    from pipeline.launcher import RunDirError, check_run_dir, run_dir_of

    try:
        if args.command in ("status", "set"):
            return _remote(args)
        if args.command == "keys":
            return _keys(args)
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
        if args.command in ("learner", "run"):
            from learner.checkpoint import check_resume
            from learner.launch import world_size
            from pipeline.security import check_exposure

            check_exposure(cfg)
            if not env_flag("RANK"):  # more ranks than GPUs given is refused here, not in torch.cuda.set_device
                world_size(cfg.trainer.ranks, args.gpus or (cfg.run.learner_gpus if args.command == "run" else None))
            if resume is not None and checks:  # another model or LoRA scale than the run's is refused at start
                for change in check_resume(cfg, resume.resolve()):
                    print(f"pipeline {args.command}: resuming with {change} (RUN_DIR/config.yaml has the first)",
                          file=sys.stderr)
            if launched() and resume is None and args.run_dir is None and not cfg.run.name:
                raise RunDirError("under torchrun every rank must name the same run directory: pass --run-dir DIR "
                                  "(or set run.name), the same on every node")
            run_dir = run_dir_of(cfg, resume or args.run_dir)
            if resume is None and checks:
                check_run_dir(run_dir, resume=False)
    except ConfigError as e:
        print(f"pipeline: config error: {e}", file=sys.stderr)
        return 2
    except (RunDirError, CheckpointError) as e:
        print(f"pipeline {args.command}: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.run.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        apply_environment(cfg, args.gpus)
    except ConfigError as e:
        print(f"pipeline: {e}", file=sys.stderr)
        return 2
    if args.command == "run":
        from pipeline.launcher import launch

        return launch(cfg, run_dir, resume=resume is not None, profile=args.profile)
    if args.command == "learner":
        from learner.launch import end_with_parent, run_ranks, world_size

        run_dir.mkdir(parents=True, exist_ok=True)
        world = world_size(cfg.trainer.ranks, args.gpus)
        if world > 1 and not env_flag("RANK"):  # this host's ranks, under torchrun's agent, same run directory
            child = sys.argv[1:] if argv is None else list(argv)
            if args.run_dir is None and args.resume is None:
                child += ["--run-dir", str(run_dir)]
            return run_ranks(child, world)
        parent = os.getppid()
        if launched():
            end_with_parent()
        from learner.checkpoint import CheckpointError
        from learner.hub import HubStopped
        from learner.ranks import RankLost
        from learner.service import NotFinite
        from learner.service import main as learner_main

        try:
            learner_main(cfg, run_dir, resume=resume is not None, token=args.launch_token, profile=args.profile)
        except (HubStopped, NotFinite, CheckpointError, RankLost) as e:  # the run cannot go on: why, no traceback
            logging.getLogger("pipeline").error("the run failed: %s", e)
            return 1
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (learner.service turns it into this)
            who = f" rank {env_flag('RANK')} on host {socket.gethostname()}" if launched() else ""
            orphan = " (its launcher, torchrun's agent, is gone)" if os.getppid() != parent else ""
            logging.getLogger("pipeline").warning("learner%s stopped by a signal%s; the hub and its files are gone",
                                                  who, orphan)
            return 130
        return 0
    from pipeline.supervise import guarded, supervise

    if not guarded():  # started by hand: this process supervises the real generator, which has a guard
        return supervise([sys.executable, "-m", "pipeline.cli", *(sys.argv[1:] if argv is None else argv)])
    from generator.service import main as generator_main
    from pipeline.config import read_yaml
    from pipeline.runspec import explicit_keys

    explicit = explicit_keys(read_yaml(args.config) if args.config else {}, args.overrides)  # what it claims
    return asyncio.run(generator_main(cfg, args.learner, args.gpus or "", explicit, args.profile))


def _keys(args) -> int:
    from pipeline.security import HUB, make_keys

    new = not (args.dir / f"{HUB}.key_secret").exists()
    if not new and not (args.generator or args.operator):
        raise ConfigError(f"pipeline keys: {args.dir} holds keys already; add one with --generator NAME or "
                          "--operator NAME")
    generators = args.generator or (["generator"] if new else [])
    operators = args.operator or (["operator"] if new else [])
    for path in make_keys(args.dir, generators, operators):
        print(path)
    print(f"learner: auth.keys: {args.dir} (it reads hub.key_secret, generators/, operators/)\n"
          f"generator host: copy {args.dir}/hub.key and {args.dir}/NAME.key_secret into its keys folder, set "
          "auth.keys to it and auth.identity: NAME\n"
          f"pipeline status/set: --keys {args.dir} [--identity NAME]")
    return 0


def _remote(args) -> int:
    from pipeline import protocol as P
    from pipeline.client import request_once
    from pipeline.config import parse_override
    from pipeline.security import client_keys
    from pipeline.status import render

    keys = client_keys(args.keys, args.identity)
    try:
        if args.command == "set":
            for item in args.items:
                key, value = parse_override(item)
                reply = request_once(args.learner, P.SetRequest(key, value), keys=keys)
                if isinstance(reply, P.Error):
                    print(f"pipeline set: {reply.message}", file=sys.stderr)
                    return 2
                print(f"{key} = {reply.value!r} (from step {reply.from_step})")
            return 0
        while True:
            reply = request_once(args.learner, P.StatusRequest(), keys=keys)
            if not isinstance(reply, P.StatusReply):
                print(f"pipeline status: {getattr(reply, 'message', reply)}", file=sys.stderr)
                return 2
            print(("\033[2J\033[H" if args.watch else "") + render(reply), flush=True)
            if not args.watch:
                return 0
            time.sleep(2)
    except P.PeerLost as e:
        print(f"pipeline {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
