"""`generator.rollout: builtin:agent`: the user's agent program, unchanged, as the rollout of each leased prompt.

Each of a group's n samples is a session of the generator's OpenAI-compatible endpoint (generator/endpoint.py) and
one run of the agent, in one of two forms:

    generator.agent: my_module:agent          async def agent(client, item) -> str   (client: openai.AsyncOpenAI)
    generator.agent_command: [python, my_agent.py]   OPENAI_BASE_URL and OPENAI_API_KEY set; the prompt as JSON on
                                                     stdin ({"prompt" or "messages", "columns"}); prints the answer

What the reward functions score is the answer (the callable's return value, the command's output). What is trained is
what the endpoint recorded: the sampled token ids and their behaviour log-probs, each turn with the weights version
that sampled it, the tokens the prompts added in between (a tool's reply) with mask 0. Where a call's prompt did not
extend the previous call's context, the trajectory goes on as another sample of the group (`Trajectory.trajectory`:
which trajectory it belongs to; its own `prompt_ids`), sharing the trajectory's reward; the learner counts these
splits (agent/splits).

An agent still running after generator.agent_timeout_s is stopped (a command's process group killed), and one that
raises or exits non-zero fails: its sample gets reward 0 (`agent_failure: zero`, finish reason agent_timeout or
agent_error; the hub counts it and names it in events.jsonl) or the prompt is leased again (`requeue`). Its session is
closed first, so the endpoint refuses the agent's later calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from generator.agent_sessions import Part, Session
from generator.agent_workers import AgentWorkers, Ran
from generator.endpoint import Endpoint, in_process_http
from generator.rollout import AgentFailed, Context, Trajectory, seed_of
from generator.toolcalls import ToolCalls
from pipeline.tasks import load_callable

log = logging.getLogger(__name__)


class AgentRollout:
    """The rollout strategy (generator/spec.py makes one per run config); its endpoint starts on first use."""

    def __init__(self, cfg, worker=False):
        """`worker`: in an agent worker's process (generator/agent_worker.py), whose generator checked the config."""
        g = cfg.generator
        self.agent = load_callable(g.agent, "generator.agent") if g.agent else None
        self.command, self.timeout, self.failure = list(g.agent_command), g.agent_timeout_s, g.agent_failure
        self.endpoint = Endpoint(chat_template=chat_template(g.chat_template),
                                 tool_calls=ToolCalls(g.tool_parser, lazy=worker), max_model_len=g.max_model_len)
        self._http: Any = None  # under every sample's openai client: the endpoint's app in-process (in_process_http)
        # generator.agent_workers: the samples' agents and endpoint sessions in processes of their own
        self.workers = AgentWorkers(cfg, g.agent_workers) if g.agent_workers else None

    async def __call__(self, engine, prompt_ids: list[int], ctx: Context) -> list[Trajectory]:
        # a worker's record of the session (Ran) or the session itself: trajectory() reads the parts and extra of either
        run: Callable[[Any, Context, int], Coroutine[Any, Any, tuple[Session | Ran, str, str]]] = \
            self.workers.sample if self.workers is not None else self._sample
        try:  # one sample failing under agent_failure requeue stops the others: the prompt is leased again whole
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(run(engine, ctx, i)) for i in range(ctx.n)]
        except* AgentFailed as raised:
            raise raised.exceptions[0] from None
        runs = [t.result() for t in tasks]
        out = []
        for t, (session, answer, failed) in enumerate(runs):
            out += trajectory(session.parts, prompt_ids, t, answer, failed, engine.version, session.extra)
        return out

    async def aclose(self) -> None:
        if self.workers is not None:
            await self.workers.aclose()
        if self._http is not None:
            await self._http.aclose()
        await self.endpoint.stop()

    async def prepare(self) -> None:
        """What a first sample would otherwise pay inside its agent's timeout: the endpoint's start and, for an agent
        callable, the openai client's import (0.9 s on a slow core: a hung agent with a 1 s timeout had its one
        call cut while the engine's reply was on its way, so its trajectory lacked the tokens sampled)."""
        await self.endpoint.start()
        if self.agent is not None:
            import openai  # noqa: F401

    async def _sample(self, engine, ctx: Context, index: int) -> tuple[Session, str, str]:
        await self.prepare()  # the agent's timeout counts the agent's own time
        session = self.endpoint.open(engine, ctx.tokenizer, ctx.sampling, seed_of(ctx.seed, index))
        try:
            answer = await asyncio.wait_for(self._run(session, ctx), self.timeout)
            return session, answer, ""
        except asyncio.CancelledError:
            raise
        except Exception as e:
            why = "agent_timeout" if isinstance(e, TimeoutError) else "agent_error"
            detail = f"no answer within generator.agent_timeout_s={self.timeout}" if why == "agent_timeout" \
                else f"{type(e).__name__}: {e}"
            log.warning("agent for prompt %d failed after %d calls (%s)", ctx.item.prompt_id, session.calls, detail)
            if self.failure == "requeue":
                raise AgentFailed(f"{why}: {detail}") from None
            return session, "", why
        finally:
            self.endpoint.close(session)

    async def _run(self, session: Session, ctx: Context) -> str:
        if self.agent is not None:
            from openai import AsyncOpenAI

            if self._http is None:
                self._http = in_process_http(self.endpoint.asgi)
            client = AsyncOpenAI(base_url=self.endpoint.base_url, api_key=session.key, max_retries=0,
                                 timeout=self.timeout, http_client=self._http)  # not closed: that closes the shared one
            answer = await self.agent(client, ctx.item)
            return "" if answer is None else str(answer)
        return await self._command(session, ctx)

    async def _command(self, session: Session, ctx: Context) -> str:
        env = dict(os.environ, OPENAI_BASE_URL=self.endpoint.base_url, OPENAI_API_KEY=session.key)
        proc = await asyncio.create_subprocess_exec(*self.command, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env=env, start_new_session=True)
        item = {"messages": ctx.item.messages} if ctx.item.messages else {"prompt": ctx.item.prompt}
        try:
            out, err = await proc.communicate(json.dumps(item | {"columns": ctx.item.columns}).encode())
        finally:
            if proc.returncode is None:  # timed out or cancelled: its whole process group, by its id
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if proc.returncode:
            raise RuntimeError(f"{' '.join(self.command)} exited {proc.returncode}: "
                               f"{err.decode(errors='replace')[-2000:]}")
        return out.decode(errors="replace").strip()


def chat_template(path: str) -> str | None:
    """generator.chat_template's text (None: the tokenizer's own)."""
    if not path:
        return None
    with open(path) as f:
        return f.read()


def trajectory(parts: list[Part], prompt_ids: list[int], index: int, answer: str, failed: str,
               version: int, extra: dict | None = None) -> list[Trajectory]:
    """The samples of trajectory `index` from its session's parts: each part a sample, its own context where that is
    not the leased prompt; every one carries the answer (scored once for all) and, failed, the reason."""
    parts = parts or [Part(list(prompt_ids), first_version=version, last_version=version)]  # no call: an empty sample
    out = []
    for part in parts:
        out.append(Trajectory(part.token_ids, part.logprobs, part.mask, failed or part.finish_reason,
                              part.first_version, part.last_version, part.gen_ms, text=answer,
                              prompt_ids=None if part.prompt_ids == prompt_ids else part.prompt_ids,
                              trajectory=index, turns=part.turns, extra=dict(extra or {})))
    return out
