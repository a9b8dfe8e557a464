"""`pipeline keys DIR`: CURVE key pairs for auth.keys: the hub's, generators', operators' (pipeline/security.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.config import ConfigError


def add_parser(sub) -> None:
    ks = sub.add_parser("keys", help="make CURVE key pairs for auth.keys: the hub's, generators', operators'")
    ks.add_argument("dir", type=Path)
    ks.add_argument("--generator", action="append", default=[], metavar="NAME", help="add a generator key pair")
    ks.add_argument("--operator", action="append", default=[], metavar="NAME", help="add an operator key pair")
    ks.set_defaults(main=main)


def main(args: argparse.Namespace, argv: list[str] | None) -> int:
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
