"""`pipeline`: the command line. Each subcommand's file adds its arguments and its `main` (args, argv) -> exit code;
a user's mistake found at start (a bad config, a run directory in the way, a checkpoint that does not fit) is one
line and exit code 2."""

from __future__ import annotations

import argparse
import sys

from pipeline.config import ConfigError
from pipeline.entrypoints import generator, keys, learner, remote, run
from pipeline.entrypoints.service import Refused


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeline", description="Asynchronous pipelined RL for language models.")
    sub = p.add_subparsers(dest="command", required=True)
    for command in (run, learner, generator, remote, keys):
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from learner.checkpoint import CheckpointError
    from pipeline.launcher import RunDirError

    try:
        return args.main(args, argv)
    except (ConfigError, RunDirError, CheckpointError, Refused) as e:
        if getattr(args, "started", False):
            raise  # past a service's start (service.prepare), its errors are its own
        if isinstance(e, ConfigError):
            message = f"pipeline: config error: {e}"
        elif isinstance(e, Refused):
            message = f"pipeline: {e}"
        else:
            message = f"pipeline {args.command}: {e}"
        print(message, file=sys.stderr)
        return 2
