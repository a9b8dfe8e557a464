"""Chaos: everything that goes wrong in a long run, in one run, with authentication on.

A 2-rank ZeRO-3 learner (gloo) with CURVE keys and three generators (started first: they retry until the
hub is up, so all three are there from the start whatever engines cost to start); one is frozen and killed
(SIGKILL) holding a lease, one loses its vLLM engine core (SIGKILL to the engine process), one's reward function raises;
a peer with a valid key injects a rollout with a NaN log-prob and speaks for another generator; an operator
changes knobs; the learner is killed (SIGKILL, both ranks) one step past a checkpoint and resumed, and the
surviving generator, holding weights newer than the checkpoint, reconnects during the resumed learner's first
publish. One epoch of the dataset must be trained exactly once across all of it: 0 prompts lost, 0 trained
twice, 0 invalid samples trained, the staleness bound kept, the weights finite at the end.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.metrics import read_jsonl
from pipeline.security import client_keys, make_keys
from tests.conftest import wait_for
from tests.integration.helpers import descendants, events, held_at, start_generator, start_learner
from tests.unit.peers import Peer

pytestmark = pytest.mark.integration

# enough steps (100) for one generator to finish the run alone after the faults. The first learner holds after the
# last version but one until it is killed, so the run cannot end before the faults are done, and sleeps PACE_S a step
# so that leases are still to be had when the rogue and b want them: once torch's threads stopped spinning
# (OMP_WAIT_POLICY) a learner of this size trained all 100 steps before the faults were done
PROMPTS, BATCH, GROUP, K = 800, 8, 8, 2  # K: the bound after `pipeline set` raises it from 1 to 2
STEPS = PROMPTS // BATCH
PACE_S = 0.3


def _trained_by(run_dir, gen_id: str) -> list[list]:
    return [t for r in read_jsonl(run_dir / "metrics.jsonl") for t in r["trained"] if t[3] == gen_id]


def _steps(run_dir) -> int:
    return len(read_jsonl(run_dir / "metrics.jsonl"))


def _run_id(run_dir) -> str:
    return json.loads((run_dir / "hub.json").read_text())["run_id"]


def _id_of(run_dir, proc) -> str:
    return next(e["generator"] for e in events(run_dir, "register") if f"-{proc.pid}-" in e["generator"])


def test_chaos(procs, tmp_path, model_cache, free_port):
    run_dir, keys = tmp_path / "chaos", tmp_path / "keys"
    make_keys(keys, ["gen", "rogue"], ["operator"])
    common = [f"trainer.total_steps={STEPS}", "trainer.epochs=1", f"data.size={PROMPTS}",
              f"trainer.batch_size={BATCH}", f"trainer.group_size={GROUP}", "trainer.max_staleness=1",
              "trainer.ranks=2", "trainer.zero_stage=3", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2",
              "hub.heartbeat_s=0.5", "hub.heartbeat_timeout_s=4", "hub.max_reward_errors=5",
              "generator.max_inflight_groups=8", "rewards=[{fn: 'tests.integration.chaos_rewards:flaky_echo'}]",
              f"auth.keys={keys}", "auth.identity=gen"]
    hub = f"tcp://127.0.0.1:{free_port}"
    operator = client_keys(str(keys), "operator")
    timeline = []
    run_dir.mkdir()
    gen_a = start_generator(procs, run_dir, free_port, common, "a", env={"CHAOS_REWARD_RAISES": "3"})
    # b's engine core spawned, as a generator's later engines are: it leaves shared-memory segments when killed
    # (a forked one makes none), which must go too
    gen_b = start_generator(procs, run_dir, free_port, common, "b", env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    gen_c = start_generator(procs, run_dir, free_port, common, "c")
    # killed with SIGKILL below, its torchrun agent cannot remove its temp folder: it goes under tmp_path
    paced = {"PIPELINE_TEST_SLOW_STEP_S": str(PACE_S), **held_at(STEPS - 1)}
    learner = start_learner(procs, run_dir, free_port, common, env={"TMPDIR": str(tmp_path), **paced})
    watch = [learner, gen_a, gen_b, gen_c]
    wait_for(lambda: len(events(run_dir, "register")) >= 3, 600, "three generators to register", watch)
    id_a, id_b, id_c = (_id_of(run_dir, g) for g in (gen_a, gen_b, gen_c))
    wait_for(lambda: all(_trained_by(run_dir, g) for g in (id_a, id_b, id_c)), 300, "all three to contribute", watch)
    run_ids = [_run_id(run_dir)]  # the killed learner's folder in /dev/shm is named after it
    timeline.append(f"step {_steps(run_dir)}: three generators contribute")

    # the operator sees and tunes the run; only with the operator's key; out-of-range values are refused
    status = _cli("status", "--learner", hub, "--keys", str(keys))
    assert status.returncode == 0 and all(g in status.stdout for g in (id_a, id_b, id_c)), status
    not_operator = _cli("status", "--learner", hub, "--keys", str(keys), "--identity", "gen")
    assert not_operator.returncode == 2 and "needs an operator key" in not_operator.stderr
    changed = _cli("set", "--learner", hub, "--keys", str(keys), "trainer.max_staleness=2", "trainer.lr=1e-3")
    assert changed.returncode == 0, changed.stderr
    from_step = int(changed.stdout.split("from step ")[1].split(")")[0])
    refused = _cli("set", "--learner", hub, "--keys", str(keys), "sampling.temperature=0")
    assert refused.returncode == 2 and "sampling.temperature: must be in (0, 10]" in refused.stderr
    wait_for(lambda: "rank 1: trainer.lr = 0.001" in learner.tail(400), 120, "the change to reach rank 1", [learner])
    timeline.append(f"step {_steps(run_dir)}: max_staleness=2, lr=1e-3 set by the operator, on both ranks")

    # a peer with a valid generator key: a NaN log-prob in a rollout, and a heartbeat in another's name
    rogue = Peer(hub, "rogue", client_keys(str(keys), "rogue"))
    assert isinstance(rogue.register(), P.Welcome)
    lease = wait_for(lambda: (lambda r: r if isinstance(r, P.Lease) else None)(rogue.lease(1)), 60,
                     "room in the staleness window", [learner])
    rogue.send(rogue.group(lease, lease.groups[0], version=lease.min_version, group_size=GROUP, tokens=(4, 4),
                           logprobs=(math.nan, -1.0)))
    assert "did not register it" in rogue.ask(P.Heartbeat(id_c, 0, draining=True)).message
    wait_for(lambda: request_once(hub, P.StatusRequest(), keys=operator).counters.get("rejected/logprob"),
             30, "the NaN rollout to be rejected", [learner])
    rogue.ask(P.Leave("rogue"))
    rogue.close()
    timeline.append(f"step {_steps(run_dir)}: a rogue generator's NaN rollout rejected, its prompt leased again")

    # freeze b while it holds a lease, then SIGKILL it: its leased prompts go back to the queue
    deadline = time.monotonic() + 120
    while True:
        os.killpg(gen_b.pid, signal.SIGSTOP)
        rows = {g.id: g for g in request_once(hub, P.StatusRequest(), keys=operator).generators}
        if rows[id_b].leases > 0 or time.monotonic() > deadline:
            break
        os.killpg(gen_b.pid, signal.SIGCONT)
        time.sleep(0.2)
    assert rows[id_b].leases > 0, "b never held a lease"
    segments = (Path("/dev/shm") / f"pipeline-recv-{gen_b.pid}" / "segments").read_text().split()  # its engine's
    gen_b.stop(grace=0)  # SIGKILL to its process group: nobody unlinks them now
    requeue = wait_for(lambda: [e for e in events(run_dir, "requeue") if e["generator"] == id_b], 60,
                       "b to be declared dead", [learner])[0]
    assert requeue["prompts"] > 0
    timeline.append(f"step {_steps(run_dir)}: b killed holding leases; {requeue['prompts']} prompts re-queued")

    # a's vLLM engine core dies: a leaves at once with the engine's error, its leases re-queued, and exits 1
    core = [p for p, cmd in descendants(gen_a.pid) if "EngineCore" in cmd or "spawn_main" in cmd]
    assert core, descendants(gen_a.pid)
    os.kill(core[0], signal.SIGKILL)
    assert gen_a.wait(60) == 1, gen_a.tail()
    leave = next(e for e in events(run_dir, "leave") if e["generator"] == id_a)
    assert "vLLM engine died" in leave["reason"], leave
    timeline.append(f"step {_steps(run_dir)}: a's engine core killed; a left: {leave['reason'][:60]}...")

    # the learner dies (both ranks, SIGKILL) one step past a checkpoint, with c holding the newer weights. It is
    # stopped (SIGSTOP) before each look, so the step it is killed at is the one seen, not one it finished meanwhile
    def stopped_past_a_checkpoint() -> bool:
        assert learner.proc.poll() is None, learner.tail()  # held after version STEPS - 1: it cannot have ended
        _signal_learner(learner.pid, signal.SIGSTOP)
        n, latest = _steps(run_dir), run_dir / "checkpoints" / "latest"
        applied = [e["version"] for e in events(run_dir, "weights_applied") if e["generator"] == id_c]
        if n % 2 == 1 and n > 8 and max(applied or [0]) >= n and latest.exists() and int(latest.read_text()[1:]) < n:
            return True
        _signal_learner(learner.pid, signal.SIGCONT)
        return False

    wait_for(stopped_past_a_checkpoint, 300, "an odd version applied by c", [learner, gen_c])
    _signal_learner(learner.pid, signal.SIGKILL)
    learner.wait(30)
    killed_at = _steps(run_dir)
    checkpoint = int((run_dir / "checkpoints" / "latest").read_text()[1:])
    assert checkpoint < killed_at
    timeline.append(f"step {killed_at}: learner killed (SIGKILL, 2 ranks); newest checkpoint v{checkpoint}")
    n_events = len(read_jsonl(run_dir / "events.jsonl"))
    resumed = start_learner(procs, run_dir, free_port, common, ["--resume", str(run_dir)])
    wait_for(lambda: events(run_dir, "register", n_events), 300, "c to reconnect", [resumed, gen_c])
    assert resumed.wait(900) == 0, resumed.tail()
    run_ids.append(_run_id(run_dir))
    assert gen_c.wait(60) == 0, gen_c.tail()  # it leaves once the run is complete
    after = events(run_dir, after=n_events)
    applied = [e["version"] for e in after if e["event"] == "weights_applied" and e["generator"] == id_c]
    assert applied[0] == checkpoint and applied[-1] == STEPS  # the resumed weights first; the final ones last
    timeline.append(f"learner resumed at v{checkpoint}; c reconnected and loaded v{applied[0]} first")

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))  # unbroken versions after the resume
    trained = [(t[0], t[1]) for r in records for t in r["trained"]]
    assert len(trained) == len(set(trained)) == PROMPTS  # 0 lost, 0 twice
    assert set(trained) == {(0, pid) for pid in range(PROMPTS)}
    ledger = json.loads((run_dir / "checkpoints" / f"v{STEPS}" / "hub.json").read_text())
    assert ledger["trained_groups"] == PROMPTS and ledger["pending"] == [] and ledger["fresh"] == 0
    assert all(0 <= r["step"] - t[2] <= K for r in records for t in r["trained"])  # the bound, and no future
    assert not [t for r in records for t in r["trained"] if t[3] == "rogue"]  # 0 invalid samples trained
    assert all(t[2] >= checkpoint for r in records[checkpoint:] for t in r["trained"] if t[3] == id_c)
    last = records[-1]
    assert last["hub/rejected/logprob"] >= 1 and last["hub/reward_errors"] >= 1  # counters survived the resume
    assert all(r["max_staleness"] == 2 for r in records[from_step:])  # from the step the reply named
    assert all(r["lr"] == 1e-3 for r in records[checkpoint:])  # the change survived the resume
    assert learner_log_count(resumed, "re-applied run-time changes from changes.jsonl") == 2  # on both ranks
    reward_error = events(run_dir, "reward_error")[0]
    assert "ZeroDivisionError" in reward_error["error"] and "flaky_echo" in reward_error["error"]
    assert (0, reward_error["prompt_id"]) in set(trained)  # its prompt was trained after all
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("v*")) == sorted([f"v{STEPS - 2}", f"v{STEPS}"])
    _check_final_weights(run_dir)
    # this run's folders by their names alone: another test's run may have its own in /dev/shm meanwhile
    mine = {f"pipeline-{r}" for r in run_ids} | {f"pipeline-recv-{g.pid}" for g in (gen_a, gen_b, gen_c)}
    leftovers = [p for p in Path("/dev/shm").glob("pipeline-*") if p.name in mine]
    assert not leftovers, leftovers  # the killed learner's files were removed by the resumed one
    assert segments and not [n for n in segments if (Path("/dev/shm") / n).exists()]  # b's engine's too
    gone = _cli("status", "--learner", hub, "--keys", str(keys))  # a finished learner: a clear error, not a hang
    assert gone.returncode == 1 and "no reply from the learner" in gone.stderr
    print("timeline:\n  " + "\n  ".join(timeline))
    print(f"prompts {PROMPTS}, trained {len(trained)} once each; counters "
          f"{ {k: v for k, v in last.items() if k.startswith('hub/') and v} }")


def learner_log_count(proc, text: str) -> int:
    return proc.log_path.read_text(errors="replace").count(text)


def _check_final_weights(run_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.tinymodel import resolve_model_path

    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    initial = load_file(f"{resolve_model_path('builtin:tiny')}/model.safetensors")
    moved = 0.0
    for name, p in final.state_dict().items():
        assert p.shape == initial[name].shape, name  # gathered from ZeRO-3 shards, complete
        assert torch.isfinite(p).all(), name
        moved += float((p - initial[name]).abs().sum())
    assert moved > 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=60)


def _signal_learner(pid: int, sig: int) -> None:
    """The learner's process group and its ranks': torchrun's agent starts each rank in a session of its own."""
    for group in (*[p for p, _ in descendants(pid) if _leads_a_group(p)], pid):
        os.killpg(group, sig)


def _leads_a_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False
