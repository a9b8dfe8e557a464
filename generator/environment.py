"""`generator.rollout: builtin:environment`: a TRL environment_factory class, unchanged, as the rollout of each leased
prompt.

    generator.environment: my_module:MyEnv      one instance per sample
    generator.tool_parser: hermes               vLLM's parser of the model's tool calls
    generator.chat_template: tools.jinja        where the model's own template cannot render tools

The contract is TRL's (GRPOTrainer's environment_factory, and how TRL's docs use OpenEnv): the instance's
`reset(**row)` starts the episode (a string it returns is appended to the prompt's last user message); its public
methods, with docstrings and type hints, are the model's tools; reward functions get the instances as `environments`,
and `generator.environment:get_reward` scores each by its own get_reward(). The loop is TRL's too: the model answers,
its tool calls are parsed (vLLM's tool parser), run, and their replies rendered by the chat template after the model's
own tokens (after an end-of-turn token, mask 0, where the turn was cut at its length); again, until a turn calls no
tool, generator.max_tool_calls turns have, or sampling.max_tokens is spent.

Exact tokens by construction: a turn's context is the previous context, the sampled ids as they came, then the
tokens the template puts after an assistant turn for the tools' replies (mask 0), taken from a rendering of a stand-in
conversation as TRL does (its assistant turn closed, cut after it: what follows is the replies' alone): the history
is never rendered again, so a trajectory never splits. The environment's synchronous methods run on threads of its own
(`ToolThreads`), so a hung tool starves nothing else; a tool's result that is neither text nor JSON replies as its
str(); replies too long for the context left end the episode untokenized. The calls go through an
endpoint session (generator/endpoint.py) in-process, so every turn keeps its version and behaviour log-probs, and the
agent strategy's time limit and failure handling (generator/agent.py: generator.agent_timeout_s, agent_failure) apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import threading
from typing import Any

from generator.agent import AgentRollout
from generator.agent_sessions import Session
from generator.rollout import Context
from generator.toolcalls import turn_text
from pipeline.tasks import load_callable

log = logging.getLogger(__name__)
TOOL_THREADS = 32  # a generator's threads for its environments' synchronous methods (its factory, reset, tools)
# a tool's replies of more characters than this per token of context left end the episode before they are tokenized
# (no token of a tokenizer in use is near this long): a 10 MB reply took seconds of a CPU to tokenize
MAX_CHARS_PER_TOKEN = 64


class ToolThreadsFull(RuntimeError):
    """Every thread for the environment's methods runs a call that its sample gave up on."""


class ToolThreads:
    """The environment's synchronous methods on threads of their own, at most `size` at once; never the event loop's
    default executor, which also scores every group and checks weight files. Python cannot stop a thread: a call its
    sample gave up on (agent_timeout_s) keeps its thread until the function returns. Those are counted (`hung`), and
    once they hold every thread a new call fails at once, loudly and named, rather than wait behind them for ever.
    The threads are daemons: a tool that never returns does not hold the generator's exit."""

    def __init__(self, size: int = TOOL_THREADS):
        self.size, self.hung = size, 0
        self.slots = asyncio.Semaphore(size)

    async def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs): awaited where it is async, else on one of the threads (the engine's loop goes on)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        if self.hung >= self.size:
            raise ToolThreadsFull(f"all {self.size} threads for the environment's methods still run calls given up "
                                  f"on after generator.agent_timeout_s (a tool that never returns?); no call can run "
                                  f"until one returns: make the tool return, or give it a timeout of its own")
        await self.slots.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def work():
            outcome: tuple[Any, BaseException | None]  # (result, None) or (None, what it raised)
            try:
                outcome = (fn(*args, **kwargs), None)
            except BaseException as e:  # noqa: BLE001 -- handed to the awaiting coroutine as it is
                outcome = (None, e)
            with contextlib.suppress(RuntimeError):  # the loop closed while the call ran: nobody waits
                loop.call_soon_threadsafe(self._returned, done, *outcome)

        threading.Thread(target=work, name=f"environment-{getattr(fn, '__name__', 'call')}", daemon=True).start()
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            if not done.done():
                self.hung += 1
                done.add_done_callback(self._unhung)
                if self.hung >= self.size:
                    log.error("environment: all %d threads for its methods run calls that were given up on; new calls "
                              "fail until one returns", self.size)
            raise

    def _returned(self, done: asyncio.Future, result, error: BaseException | None) -> None:
        self.slots.release()
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def _unhung(self, done: asyncio.Future) -> None:
        """A call given up on returned: its thread is free again (its outcome read, so none is reported unread)."""
        self.hung -= 1
        done.exception()


class EnvironmentRollout(AgentRollout):
    def __init__(self, cfg):
        super().__init__(cfg)
        g = cfg.generator
        self.factory = load_callable(g.environment, "generator.environment")
        # the tools' JSON schemas, once, from one instance (as TRL's trainer): refused at start where it has no reset
        self.schemas = [_schema(f) for f in tools_of(self.factory()).values()]
        self.max_calls, self.max_model_len = g.max_tool_calls, g.max_model_len
        self.threads = ToolThreads()

    async def _run(self, session: Session, ctx: Context) -> str:
        env = await self.threads.call(self.factory)
        session.extra["environment"] = env
        tools = tools_of(env)
        messages = [dict(m) for m in ctx.item.messages] if ctx.item.messages else \
            [{"role": "user", "content": ctx.item.prompt}]
        observation = await self.threads.call(env.reset, prompt=ctx.item.messages or ctx.item.prompt,
                                              **ctx.item.columns)
        users = [i for i, m in enumerate(messages) if m["role"] == "user" and isinstance(m["content"], str)]
        if isinstance(observation, str) and users:  # after the last user message, as TRL's docs say
            messages[users[-1]] = dict(messages[users[-1]], content=messages[users[-1]]["content"] + observation)
        tok, schemas = ctx.tokenizer, self.schemas
        parser = self.endpoint.tool_calls
        assert parser is not None  # AgentRollout gives its endpoint one
        bootstrap = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
        ids = await asyncio.to_thread(self.render, tok, messages, schemas, bool(bootstrap))
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt with the tools' schemas is {len(ids)} tokens, and generator.max_model_len is "
                             f"{self.max_model_len}: raise generator.max_model_len")
        start = len(ids)
        for turn in range(self.max_calls + 1):
            out = await session.complete(ids, None)
            text, bootstrap = bootstrap + turn_text(tok, out.token_ids), ""
            calls = parser.read(tok, text, schemas)[1] if turn < self.max_calls else []
            if not calls:
                return text
            replies = [await self._run_tool(tools, call) for call in calls]
            room = self.max_model_len - len(ids) - len(out.token_ids)
            if sum(len(r["content"]) for r in replies) > room * MAX_CHARS_PER_TOKEN:
                return text  # replies longer than the context could hold end the episode at its tools, untokenized
            ended = [] if out.token_ids and out.token_ids[-1] == tok.eos_token_id else [tok.eos_token_id]
            added = await asyncio.to_thread(self.suffix, tok, replies, schemas)  # off the loop: replies can be long
            ids = ids + out.token_ids + ended + added  # a turn cut at its length: closed
            if len(ids) - start >= ctx.sampling.max_tokens:  # no room for the answer: the episode ends at its tools
                return text
        return text

    def render(self, tok, messages: list[dict], schemas: list[dict], continued: bool = False) -> list[int]:
        """The template's ids of `messages`: with the generation prompt, or the final (assistant) message continued."""
        return _template(tok, messages, schemas, self.endpoint.chat_template, add_generation_prompt=not continued,
                         continue_final_message=continued)

    def suffix(self, tok, replies: list[dict], schemas: list[dict]) -> list[int]:
        """The token ids the template puts after an assistant turn that called tools: their replies, then the
        generation prompt (TRL's _get_tool_suffix_ids). A stand-in conversation whose assistant turn is rendered
        closed, as a finished turn is, is cut after its last end-of-turn token: what follows it in the rendering with
        the replies is theirs alone, never a stand-in's turn."""
        call = {"type": "function", "function": {"name": replies[0]["name"], "arguments": {}}}
        stand_in: list[dict] = [{"role": "user", "content": "dummy"},
                                {"role": "assistant", "content": "", "tool_calls": [call]}]
        template = self.endpoint.chat_template
        head = _template(tok, stand_in, schemas, template, add_generation_prompt=False)
        head = _through_last(head, tok.eos_token_id)
        full = _template(tok, stand_in + replies, schemas, template, add_generation_prompt=True)
        if full[:len(head)] != head:
            raise ValueError("the chat template renders a tool's reply by changing the turn before it, so the sampled "
                             "tokens cannot be kept as they are; use a template that appends (generator.chat_template)")
        return full[len(head):]

    async def _run_tool(self, tools: dict, call) -> dict:
        """One tool call's reply message; a call that fails (no such tool, arguments that are not a JSON object, the
        tool raising, a result that is neither text nor JSON) replies with the error, as TRL's does, for the model to
        read."""
        name = call.function.name
        try:
            if name not in tools:
                raise LookupError(f"no tool named {name!r}; the tools are {', '.join(sorted(tools))}")
            args = json.loads(call.function.arguments or "{}")
            if not isinstance(args, dict):
                raise TypeError(f"arguments must be a JSON object, got {call.function.arguments!r}")
            content = _content(await self.threads.call(tools[name], **args))
        except ToolThreadsFull:
            raise  # the sample fails (counted), named: not a reply the model should learn from
        except Exception as e:
            log.debug("tool %s failed: %s: %s", name, type(e).__name__, e)
            content = json.dumps({"error": f"{type(e).__name__}: {e}"})
        return {"role": "tool", "name": name, "content": content}


def tools_of(env) -> dict:
    """The instance's tools, as TRL finds them: the public functions of its class, except reset and get_reward."""
    if not callable(getattr(env, "reset", None)):
        raise TypeError(f"generator.environment: {type(env).__name__} has no reset method (TRL's environment_factory "
                        "contract: reset(**row) -> str | None, and the tools as public methods)")
    names = [n for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
             if not n.startswith("_") and n not in ("reset", "get_reward")]
    return {n: getattr(env, n) for n in names}


def get_reward(environments=None, **kwargs) -> list[float | None]:
    """A reward function: each sample's environment's own get_reward() (TRL adds it as a reward source by itself;
    here list it in `rewards`). A sample that failed (generator.agent_timeout_s) is scored 0 whatever this says."""
    if environments is None:
        raise ValueError("builtin:environment_reward scores the instances of generator.rollout builtin:environment; "
                         "this run has none")
    out = []
    for env in environments:
        value = env.get_reward()
        out.append(asyncio.run(value) if inspect.iscoroutine(value) else value)  # scoring runs in a thread
    return out


def _content(result) -> str:
    """A tool's result as its reply's text: a string as it is, else JSON; what JSON cannot write (a numpy number, a
    set, an object) as its str(), as TRL's loop does."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def _template(tok, messages: list[dict], schemas: list[dict], template: str | None, **flags) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=schemas or None, chat_template=template, tokenize=True,
                                        return_dict=False, **flags))


def _schema(fn) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def _through_last(ids: list[int], token: int | None) -> list[int]:
    at = [i for i, t in enumerate(ids) if t == token]
    return ids[:at[-1] + 1] if at else ids
