"""`pipeline run`: the learner and its generators on this machine, as children of this process
(pipeline/launcher.py); no config: the embedded default."""

from __future__ import annotations

import argparse

from pipeline.entrypoints import service


def add_parser(sub) -> None:
    s = service.add_parser(sub, "run", "learner + generators on this machine (no config: the embedded default)", main)
    s.add_argument("--profile", action="store_true",
                   help="write RUN_DIR/trace.json: where every second of every process went (ui.perfetto.dev)")
    service.add_run_dir(s)


def main(args: argparse.Namespace, argv: list[str] | None) -> int:
    cfg, run_dir = service.prepare(args)
    assert run_dir is not None  # prepare gives `run` its run directory
    from pipeline.launcher import launch

    return launch(cfg, run_dir, resume=args.resume is not None, profile=args.profile)
