"""The learner under torchrun (torch.distributed.elastic), as a cluster starts it: two agents, each one node of a
2-node c10d rendezvous with one gloo rank, run `python -m pipeline learner` with the same run directory; the
ranks take RANK / LOCAL_RANK / WORLD_SIZE from the launcher, rank 0 serves the hub and writes hub.json, and a
generator that reads the hub's address from it trains the demo task with them. One node is lost mid-run (its agent
and its rank killed): the run ends, naming the lost rank and its host; the same commands with --resume finish it.
(A rank whose agent alone is killed ends with it: tests/unit/test_no_orphans.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from pipeline.metrics import read_jsonl
from pipeline.netutil import port_free, reserved_port
from tests.conftest import REPO, Proc, running, wait_for
from tests.integration.helpers import descendants, start_generator

pytestmark = pytest.mark.integration
STEPS, BATCH = 8, 8


def _agent(run_dir, node: int, rdzv: int, hub_port: int, log, resume: bool = False) -> Proc:
    return Proc([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
                 "--rdzv-id", "test-run", "--max-restarts", "0", "--log-dir", str(log.parent / log.stem),
                 "-m", "pipeline", "learner", "-c", "configs/demo.yaml", "--resume" if resume else "--run-dir",
                 str(run_dir), "--set", f"hub.port={hub_port}", "--set", f"trainer.total_steps={STEPS}",
                 "--set", f"trainer.batch_size={BATCH}", "--set", "trainer.checkpoint_every=2"], log)


def _nodes(run_dir, rdzv: int, hub_port: int, logs: list, resume: bool = False) -> list[Proc]:
    """Node 0's agent first, node 1's once node 0 hosts the rendezvous store, as on a cluster whose rendezvous
    endpoint is node 0: started together either agent could host it, and killing node 1 then took the store with it
    (node 0's agent ended on a broken pipe before its rank could name rank 1 gone)."""
    first = _agent(run_dir, 0, rdzv, hub_port, logs[0], resume)
    wait_for(lambda: not port_free("127.0.0.1", rdzv), 120, "node 0's rendezvous store", [first])
    return [first, _agent(run_dir, 1, rdzv, hub_port, logs[1], resume)]


def _steps(run_dir) -> int:
    return len(read_jsonl(run_dir / "metrics.jsonl"))


def test_two_torchrun_nodes_train_lose_a_node_and_resume_with_every_prompt_trained_once(procs, tmp_path,
                                                                                          model_cache):
    run_dir, hub_port = tmp_path / "run", reserved_port()
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    rdzv = reserved_port()
    agents = _nodes(run_dir, rdzv, hub_port, logs)
    try:
        hub = wait_for(lambda: (run_dir / "hub.json").exists() and json.loads((run_dir / "hub.json").read_text()),
                       600, "rank 0's hub.json", agents)
        assert hub["address"] == f"tcp://127.0.0.1:{hub_port}"  # where rank 0 serves the hub
        gen = start_generator(procs, run_dir, hub_port, [])
        wait_for(lambda: _steps(run_dir) >= 3, 600, "3 steps (a checkpoint at v2)", agents + [gen])
        # node 1 is lost: its agent and its rank (in a session of its own) killed outright
        rank1 = [pid for pid, cmd in descendants(agents[1].pid) if "-m pipeline learner" in cmd]
        assert rank1, descendants(agents[1].pid)
        for pid in (agents[1].pid, *rank1):
            os.kill(pid, signal.SIGKILL)
        assert agents[0].wait(120) != 0, agents[0].tail()  # the survivor ends, in bounded time
        wait_for(lambda: not any(running(pid) for pid in rank1), 60, "node 1's rank to end", [])
    finally:
        for agent in agents:
            agent.stop()
    lost_at = _steps(run_dir)
    assert lost_at < STEPS
    said = logs[0].read_text()
    assert f"learner rank 1 (host {socket.gethostname()}, pid {rank1[0]}) is gone" in said, said[-3000:]
    assert "learner rank 0 of 2" in said and "learner rank 1 of 2" in logs[1].read_text()  # a rank on each node

    rdzv = reserved_port()  # the same commands, with --resume; the generator reconnects to the same address
    resumed = _nodes(run_dir, rdzv, hub_port, [tmp_path / f"resumed{node}.log" for node in (0, 1)], resume=True)
    try:
        for agent in resumed:
            assert agent.wait(600) == 0, agent.tail()
        assert gen.wait(120) == 0, gen.tail()
    finally:
        for agent in resumed:
            agent.stop()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))  # the steps after the checkpoint, again
    trained = [(t[0], t[1]) for r in records for t in r["trained"]]
    assert len(trained) == len(set(trained)) == STEPS * BATCH  # every group once
    assert (run_dir / "final" / "config.json").exists() and (run_dir / "checkpoints" / f"v{STEPS}").is_dir()


def test_under_torchrun_a_learner_without_a_run_directory_is_refused():
    """Every rank must write to the same run directory: one named by each (a timestamp) would not be."""
    out = subprocess.run([sys.executable, "-m", "pipeline", "learner", "-c", "configs/demo.yaml"],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "TORCHELASTIC_RUN_ID": "x", "RANK": "0"})
    assert out.returncode == 2
    assert "under torchrun every rank must name the same run directory: pass --run-dir DIR" in out.stderr
