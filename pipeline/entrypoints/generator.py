"""`pipeline generator`: a generator service (vLLM). It serves the run's model and config, which it takes from the
learner; -c/--set say where and how it runs. Started by hand, this process supervises the real generator
(pipeline/supervise.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from pipeline.entrypoints import service


def add_parser(sub) -> None:
    s = service.add_parser(sub, "generator", "a generator service (vLLM): it serves the run's model and config, which "
                           "it takes from the learner; -c/--set say where and how it runs (GPUs, engine memory, keys)",
                           main)
    s.add_argument("--learner", required=True, help="hub address, e.g. tcp://127.0.0.1:5555")
    s.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="write this generator's timeline to DIR (the learner's RUN_DIR/trace on its host)")
    s.add_argument("--go-on-stdin", action="store_true",
                   help="import vLLM, then wait for a line on stdin before asking the hub and building the engine "
                        "(`pipeline run` starts generators that share a GPU so, and tells each in turn)")
    s.add_argument("--build-first", action="store_true",
                   help="build the engine this config names before asking the hub for the run's config, which keeps "
                        "it or builds another (`pipeline run` starts the generators it does not hold so: their config "
                        "is the run's, and the learner's hub is still starting)")


def main(args: argparse.Namespace, argv: list[str] | None) -> int:
    cfg, _ = service.prepare(args)
    from pipeline.supervise import guarded, supervise

    if not guarded():  # started by hand: this process supervises the real generator, which has a guard
        return supervise([sys.executable, "-m", "pipeline", *(sys.argv[1:] if argv is None else argv)])
    from generator.service import main as generator_main
    from pipeline.config import read_yaml
    from pipeline.runspec import explicit_keys

    explicit = explicit_keys(read_yaml(args.config) if args.config else {}, args.overrides)  # what it claims
    return asyncio.run(generator_main(cfg, args.learner, args.gpus or "", explicit, args.profile, args.go_on_stdin,
                                      args.build_first))
