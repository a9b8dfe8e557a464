"""generator.agent_workers (generator/agent_workers.py): the agents run in worker processes of their own (real
processes, real ZeroMQ), and ask this process's engine (scripted, as in test_agent.py) for each completion. What must
hold: the trajectories are the ones the agents make on the generator's loop (ids, log-probs, mask, versions,
answers), a hung agent still ends at its timeout, a worker that dies fails its samples by name and no worker outlives
the rollout, a cancelled group cancels its engine calls, and a frame of no message of ours is dropped and counted.
The workers start at once, and import vLLM's tool parsers only at a first tool call."""

from __future__ import annotations

import asyncio
import os
import signal

import msgpack
import pytest

from generator.agent import AgentFailed, AgentRollout
from generator.agent_workers import AgentWorkers
from pipeline.config import ConfigError
from tests.unit.test_agent import ScriptedEngine, _cfg, _ctx, _prompt

pytestmark = pytest.mark.asyncio
AGENTS = "tests.unit.test_agent"
REPLIES = [["I will use the calculator for the ans", "wer."], "The sum is 42.", "42"]


@pytest.fixture
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


async def _run(tok, workers: int, replies, versions=None, n=1, **generator):
    cfg = _cfg(agent_workers=workers, **generator)
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg, n=n)
    engine = ScriptedEngine(tok, replies, versions=versions)
    try:
        return await rollout(engine, _prompt(tok, ctx), ctx), engine, rollout
    finally:
        await rollout.aclose()


async def by_column(client, item):
    """test_agent.py's agent that item.columns["agent"] names: one worker set serves them all."""
    from tests.unit import test_agent

    return await getattr(test_agent, item.columns["agent"])(client, item)


def _item_ctx(tok, cfg, agent: str, n: int = 1):
    ctx = _ctx(tok, cfg, n=n)
    ctx.item.columns["agent"] = agent
    return ctx


async def test_workers_make_the_trajectories_of_the_generators_loop_and_drop_frames_of_no_message(tok, monkeypatch):
    (here,), engine_here, _ = await _run(tok, 0, REPLIES, [3, 3, 4], agent=f"{AGENTS}:tool_agent")
    cfg = _cfg(agent_workers=2, agent=f"{__name__}:by_column")
    rollout = AgentRollout(cfg)
    starts = []  # the workers start at once: both spawned before either is ready (one after another took 67 s for 8)
    spawn, handle = asyncio.create_subprocess_exec, AgentWorkers._handle

    async def spawned(*args, **kw):
        starts.append("spawned")
        return await spawn(*args, **kw)

    def handled(self, name, kind, args):
        if kind == "ready":
            starts.append(kind)
        return handle(self, name, kind, args)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawned)
    monkeypatch.setattr(AgentWorkers, "_handle", handled)
    try:
        ctx = _item_ctx(tok, cfg, "tool_agent")
        engine = ScriptedEngine(tok, REPLIES, versions=[3, 3, 4])
        (there,) = await rollout(engine, _prompt(tok, ctx), ctx)
        assert starts == ["spawned", "spawned", "ready", "ready"]
        assert engine.prompts == engine_here.prompts and engine.sampled == engine_here.sampled
        for name in ("token_ids", "logprobs", "mask", "turns", "first_version", "last_version", "text", "prompt_ids",
                     "finish_reason", "trajectory"):
            assert getattr(there, name) == getattr(here, name), name
        assert there.text == "42" and [v for _, v in there.turns] == [3, 3, 4]
        assert any(m == 0 for m in there.mask)  # the tool's reply, out of the loss
        # a group spread over both workers, each sample its own session: each splits once, as on the loop
        ctx = _item_ctx(tok, cfg, "editing_agent", n=3)
        engine = ScriptedEngine(tok, ["Let me think."] * 6)
        trajs = await rollout(engine, _prompt(tok, ctx), ctx)
        assert sorted(t.trajectory for t in trajs) == [0, 0, 1, 1, 2, 2] and len(engine.prompts) == 6
        assert len(rollout.workers.procs) == 2
        # frames of no message of ours: dropped and counted, nothing else changes
        import zmq
        import zmq.asyncio

        stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        stranger.connect(f"ipc://{rollout.workers._dir}/sock")
        await stranger.send(b"\xc1 not msgpack")
        await stranger.send(msgpack.packb(["generate", 12345, 0, [1, 2], {}, None]))  # no such sample: answered no
        await stranger.send(msgpack.packb(["stolen", 1]))
        for _ in range(100):
            if rollout.workers.refused >= 2:
                break
            await asyncio.sleep(0.05)
        assert rollout.workers.refused == 2
        assert msgpack.unpackb(await asyncio.wait_for(stranger.recv(), 10))[0] == "completion"
        stranger.close(linger=0)
        ctx = _item_ctx(tok, cfg, "tool_agent")
        (again,) = await rollout(ScriptedEngine(tok, REPLIES, versions=[3, 3, 4]), _prompt(tok, ctx), ctx)
        assert again.token_ids == here.token_ids
    finally:
        workers = rollout.workers
        await rollout.aclose()
    assert not workers.procs and workers._dir is None  # stopped, the socket's directory removed


async def test_a_hung_agent_in_a_worker_still_ends_at_its_timeout(tok):
    (traj,), engine, _ = await _run(tok, 1, ["Let me think."], agent=f"{AGENTS}:hanging_agent", agent_timeout_s=1.0)
    assert traj.finish_reason == "agent_timeout" and traj.token_ids == engine.sampled[0]
    with pytest.raises(AgentFailed, match="agent_timeout"):
        await _run(tok, 1, ["Let me think."] * 2, n=2, agent=f"{AGENTS}:hanging_agent", agent_timeout_s=1.0,
                   agent_failure="requeue")


async def test_a_worker_that_dies_fails_its_samples_by_name_and_the_next_sample_starts_another(tok):
    cfg = _cfg(agent_workers=1, agent=f"{__name__}:by_column", agent_timeout_s=600.0)
    rollout = AgentRollout(cfg)

    async def killed(ctx) -> asyncio.Task:
        group = asyncio.create_task(rollout(ScriptedEngine(tok, ["Let me think."] * 2), _prompt(tok, ctx), ctx))
        while len(rollout.workers.calls) < 2 and not group.done():  # both agents made their first call
            await asyncio.sleep(0.05)
        (proc,) = rollout.workers.procs.values()
        os.kill(proc.pid, signal.SIGKILL)
        return group, proc

    procs = []  # every worker this test saw
    try:
        ctx = _item_ctx(tok, cfg, "hanging_agent", n=2)
        group, proc = await killed(ctx)
        procs.append(proc)
        trajs = await asyncio.wait_for(group, 30)
        assert [t.finish_reason for t in trajs] == ["agent_error", "agent_error"] and proc.returncode == -9
        ok = _item_ctx(tok, cfg, "tool_agent")
        (traj,) = await rollout(ScriptedEngine(tok, REPLIES), _prompt(tok, ok), ok)  # a new worker serves
        assert traj.text == "42" and list(rollout.workers.procs.values()) != procs
        rollout.workers.failure = "requeue"  # under requeue the prompt is leased again, the worker named
        group, proc = await killed(ctx)
        procs.append(proc)
        with pytest.raises(AgentFailed, match=f"pid {proc.pid}\\) exited with code -9"):
            await asyncio.wait_for(group, 30)
    finally:
        procs += rollout.workers.procs.values()
        await rollout.aclose()
    assert all(p.returncode is not None for p in procs)  # each one exited and was reaped


async def test_a_cancelled_group_cancels_its_engine_calls_and_the_workers_stop(tok):
    cfg = _cfg(agent_workers=1, agent=f"{AGENTS}:tool_agent")
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg, n=2)
    engine = ScriptedEngine(tok, REPLIES * 2, delay=3600)
    group = asyncio.create_task(rollout(engine, _prompt(tok, ctx), ctx))
    while len(rollout.workers.calls) < 2:
        await asyncio.sleep(0.05)
    calls = [t for ts in rollout.workers.calls.values() for t in ts]
    group.cancel()
    with pytest.raises(asyncio.CancelledError):
        await group
    await asyncio.sleep(0)
    assert all(t.cancelled() or t.done() for t in calls) and not rollout.workers.calls
    (proc,) = rollout.workers.procs.values()
    await rollout.aclose()
    assert proc.returncode == 0  # it stopped when asked, not killed


async def test_agent_workers_are_refused_outside_rollout_agent_and_below_zero():
    with pytest.raises(ConfigError, match="generator.agent_workers: -1"):
        _cfg(agent_workers=-1, agent=f"{AGENTS}:tool_agent")
    from pipeline.config import config_from_dict

    with pytest.raises(ConfigError, match="only rollout builtin:agent"):
        config_from_dict({"generator": {"agent_workers": 2}})


def test_a_worker_imports_vllms_tool_parsers_at_a_first_tool_call_not_at_its_start():
    """Each worker imported vLLM for its tool parser at its start (2.8 s on 2 cores, more on a GPU host, in every
    worker at once); its generator checked the parser's name already. Measured where nothing imported vLLM before."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys\nfrom generator.agent import AgentRollout\nfrom pipeline.config import config_from_dict\n"
            "cfg = config_from_dict({'generator': {'rollout': 'builtin:agent',\n"
            "                                      'agent': 'tests.unit.test_agent:tool_agent'}})\n"
            "AgentRollout(cfg, worker=True)\nprint('worker', 'vllm' in sys.modules)\n"
            "AgentRollout(cfg)\nprint('generator', 'vllm.tool_parsers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["worker", "False", "generator", "True"]
