"""`pipeline status` and `pipeline set`: a running learner's state, and its run-time knobs changed, over the hub's
control port (with its CURVE keys where auth.keys is set)."""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(sub) -> None:
    st = sub.add_parser("status", help="the learner's version, buffer and generators")
    st.add_argument("--watch", action="store_true")
    se = sub.add_parser("set", help="change run-time knobs of a running learner")
    se.add_argument("items", nargs="+", metavar="KEY=VALUE")
    for remote in (st, se):
        remote.add_argument("--learner", required=True)
        remote.add_argument("--keys", default=None, metavar="DIR", help="auth.keys of the learner (CURVE)")
        remote.add_argument("--identity", default="operator", help="operator key pair in --keys (DIR/NAME.key_secret)")
        remote.set_defaults(main=main)


def main(args: argparse.Namespace, argv: list[str] | None) -> int:
    from pipeline import protocol as P
    from pipeline.security import client_keys

    keys = client_keys(args.keys, args.identity)
    try:
        return (status if args.command == "status" else set_knobs)(args, keys)
    except P.PeerLost as e:
        print(f"pipeline {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def set_knobs(args: argparse.Namespace, keys) -> int:
    from pipeline import protocol as P
    from pipeline.client import request_once
    from pipeline.config import parse_override

    for item in args.items:
        key, value = parse_override(item)
        reply = request_once(args.learner, P.SetRequest(key, value), keys=keys)
        if isinstance(reply, P.Error):
            print(f"pipeline set: {reply.message}", file=sys.stderr)
            return 2
        assert isinstance(reply, P.SetReply)  # the hub answers a SetRequest with SetReply or Error
        print(f"{key} = {reply.value!r} (from step {reply.from_step})")
    return 0


def status(args: argparse.Namespace, keys) -> int:
    from pipeline import protocol as P
    from pipeline.client import request_once
    from pipeline.status import render

    while True:
        reply = request_once(args.learner, P.StatusRequest(), keys=keys)
        if not isinstance(reply, P.StatusReply):
            print(f"pipeline status: {getattr(reply, 'message', reply)}", file=sys.stderr)
            return 2
        print(("\033[2J\033[H" if args.watch else "") + render(reply), flush=True)
        if not args.watch:
            return 0
        time.sleep(2)
