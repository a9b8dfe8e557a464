"""An OpenAI-compatible endpoint on a generator's engine: one session per sample of an agent (generator/agent.py).

    POST /v1/chat/completions   messages (and tools) through the chat template; a turn's tool calls as OpenAI's
                                tool_calls, read by vLLM's parser (generator.tool_parser)
    POST /v1/completions        a prompt as text or token ids
    GET  /v1/models

FastAPI served by uvicorn on the generator's own event loop, bound to 127.0.0.1 on a free port. Every request
carries its session's key (`Authorization: Bearer KEY`, which the openai client sends as its api_key); a request
without one, with an unknown one, or for a session that has ended is refused (401, 410). Sampling is the lease's
(temperature, top_p): the behaviour policy the learner corrects for is the run's, so a request's own sampling
parameters are refused where they differ, as are n > 1, streaming and stop strings (not supported).

Exact tokens. A session keeps what its model saw and sampled as token ids. A prompt whose text begins with the text of
that context (the chat template rendering the history the model wrote, with a tool's reply after it) is that context's
token ids followed by the new text's: the sampled ids are never tokenized again. A prompt that does not (the history
re-rendered differently, or edited) is tokenized whole and starts a new part of the trajectory (a split). Each call is
recorded: its prompt's ids, the sampled ids, their behaviour log-probs and the weights versions that sampled them;
`Session.parts` turns the calls into the trajectory's samples. (No `from __future__ import annotations` here: FastAPI
reads the routes' annotations, and `Request` is imported where the app is made.)
"""

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline import protocol as P

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("generator.service")
ENDED = 4096  # ended sessions whose keys are remembered (their late calls told so, not just refused)


@dataclass
class Part:
    """A stretch of a trajectory whose every call extended the one before: its context, then every token after it
    (the model's, mask 1; the prompts' additions in between, a tool's reply, mask 0)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)  # (start in token_ids, version) of each call's tokens
    first_version: int = 0
    last_version: int = 0
    finish_reason: str = ""
    gen_ms: float = 0.0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Session:
    """One sample's calls. `sampling.max_tokens` bounds the tokens after each part's context; a part ends where a
    prompt does not extend it, and a session makes at most P.MAX_PARTS of them."""

    def __init__(self, key: str, engine, tokenizer, sampling: P.Sampling):
        self.key, self.engine, self.tok, self.sampling = key, engine, tokenizer, sampling
        self.parts: list[Part] = []
        self.extra: dict = {}  # what the rollout strategy keeps with the sample (an environment's instance)
        self.calls = 0
        self.open = True
        self.lock = asyncio.Lock()  # one call at a time: each extends what the one before left

    def extend(self, text: str) -> list[int]:
        """Token ids of a prompt given as text: the current part's context followed by the new text's tokens where
        the text begins with the context's, else the whole text tokenized."""
        if self.parts:
            context = self.parts[-1].context
            done = self.tok.decode(context, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if text.startswith(done):
                return context + self._ids(text[len(done):])
        return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    async def complete(self, prompt_ids: list[int], max_tokens: int | None):
        """Sample one completion of `prompt_ids` and record it in the trajectory."""
        async with self.lock:
            return await self._complete(prompt_ids, max_tokens)

    async def _complete(self, prompt_ids: list[int], max_tokens: int | None):
        part = self._part_for(prompt_ids)
        left = self.sampling.max_tokens - (len(prompt_ids) - len(part.prompt_ids))
        if left <= 0:
            raise Refused(400, f"this sample's tokens after its prompt reached sampling.max_tokens "
                               f"({self.sampling.max_tokens}): no room for another completion")
        sampling = dataclasses.replace(self.sampling, max_tokens=min(left, max_tokens or left))
        (out,) = await self.engine.generate(prompt_ids, 1, sampling)
        if not self.open:
            raise Refused(410, "the session ended while the call ran")
        if not self.parts or part is not self.parts[-1]:  # a new part, kept once its call is (a refused one is not)
            self.parts.append(part)
        added = prompt_ids[len(part.context):]  # what the prompt put after the context: the environment's tokens
        part.token_ids += added
        part.logprobs += [0.0] * len(added)
        part.mask += [0] * len(added)
        part.first_version = min(part.first_version, out.first_version) if part.turns else out.first_version
        part.last_version = max(part.last_version, out.last_version)
        part.turns.append((len(part.token_ids), out.first_version))
        part.token_ids += out.token_ids
        part.logprobs += out.logprobs
        part.mask += [1] * len(out.token_ids)
        part.finish_reason, part.gen_ms = out.finish_reason, part.gen_ms + out.gen_ms
        self.calls += 1
        return out

    def _part_for(self, prompt_ids: list[int]) -> Part:
        """The part this prompt extends, else a new one (not yet in `parts`)."""
        if self.parts:
            context = self.parts[-1].context
            if prompt_ids[:len(context)] == context:
                return self.parts[-1]
        if len(self.parts) >= P.MAX_PARTS:
            raise Refused(400, f"this sample's history was re-rendered {len(self.parts)} times (a new part each, at "
                               f"most {P.MAX_PARTS}); send the history as the model wrote it")
        return Part(list(prompt_ids))


class ToolCalls:
    """The tool calls in a model's turn, read by vLLM's tool-call parser of that name (generator.tool_parser: vLLM's
    --tool-call-parser names); a name vLLM does not have is refused when the strategy is made, at the start."""

    def __init__(self, name: str):
        from vllm.tool_parsers import ToolParserManager

        try:
            self.parser = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"generator.tool_parser: vLLM has no tool parser {name!r}; it has "
                             f"{', '.join(sorted(ToolParserManager.list_registered()))}") from None
        self.log = logging.getLogger(self.parser.__module__)

    def read(self, tok, text: str, tools: list[dict]) -> tuple[str | None, list]:
        """(the text besides the calls, the calls: vLLM's ToolCall, OpenAI's shape); no calls: (text, [])."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        # a call the model wrote wrong is no call, not an error of the run; vLLM's parsers log each with its traceback
        # (set here: vLLM's logging setup, when its engine starts, resets it)
        self.log.setLevel(logging.CRITICAL)
        request = ChatCompletionRequest.model_validate({"model": "policy", "messages": [], "tools": tools or None})
        found = self.parser(tok).extract_tool_calls(text, request)
        return (found.content, list(found.tool_calls)) if found.tools_called else (text, [])


def turn_text(tok, ids: list[int]) -> str:
    """A turn's text as a tool parser reads it: special tokens kept (some templates' tool-call tags are), the
    end-of-turn token that ended it left out."""
    if ids and ids[-1] in tok.all_special_ids:
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=False)


class Endpoint:
    """The generator's endpoint: sessions by key, and the server (started on first use, on the running loop)."""

    def __init__(self, model_name: str = "policy", chat_template: str | None = None,
                 tool_calls: ToolCalls | None = None):
        self.model_name, self.chat_template = model_name, chat_template  # None: the tokenizer's own
        self.tool_calls = tool_calls  # reads the calls of a request that offers tools
        self.sessions: dict[str, Session] = {}
        self.ended: dict[str, None] = {}  # keys of the latest sessions that ended, oldest first
        self.server: uvicorn.Server | None = None
        self.port = 0
        self._task: asyncio.Task | None = None
        self._starting = asyncio.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        async with self._starting:  # the groups of a lease start at once: one starts the server, all wait for it
            if self._task is None:
                await self._start()

    async def _start(self) -> None:
        self.server = server = _server(self.app())
        self._task = asyncio.create_task(server.serve())
        while not server.started:
            if self._task.done():
                self._task.result()  # the server could not start: its error
                raise RuntimeError("the agent endpoint stopped while starting")
            await asyncio.sleep(0.01)
        self.port = server.servers[0].sockets[0].getsockname()[1]
        log.info("agent endpoint on %s", self.base_url)

    async def stop(self) -> None:
        if self._task is not None and self.server is not None:
            self.server.should_exit = True
            await self._task
            self._task = None

    def open(self, engine, tokenizer, sampling: P.Sampling) -> Session:
        key = secrets.token_urlsafe(24)
        self.sessions[key] = session = Session(key, engine, tokenizer, sampling)
        return session

    def close(self, session: Session) -> None:
        session.open = False
        self.sessions.pop(session.key, None)
        self.ended[session.key] = None
        while len(self.ended) > ENDED:
            self.ended.pop(next(iter(self.ended)))

    def session(self, authorization: str | None) -> Session:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Refused(401, "no session key: send it as the api key (Authorization: Bearer KEY)")
        session = self.sessions.get(key)
        if session is None and key in self.ended:
            raise Refused(410, "this session has ended (its sample is done): its calls are no longer served")
        if session is None:
            raise Refused(401, "not the key of a session")
        return session

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(title="pipeline agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(Refused)
        async def refused(request: Request, e: Refused):
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=e.status)

        @app.exception_handler(Exception)
        async def failed(request: Request, e: Exception):  # the engine's (a prompt past max_model_len, ...), named
            log.warning("agent endpoint: %s %s failed: %s: %s", request.method, request.url.path, type(e).__name__, e)
            return JSONResponse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}},
                                status_code=500)

        async def opened(request: Request) -> tuple[Session, dict]:
            """A completion request's session (by its key) and body, refused where either is wrong."""
            session = self.session(request.headers.get("authorization"))
            try:
                body = await request.json()
            except ValueError as e:
                raise Refused(400, f"the request body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise Refused(400, "the request body must be a JSON object")
            _check_params(body, session.sampling)
            return session, body

        @app.get("/v1/models")
        async def models(request: Request):
            self.session(request.headers.get("authorization"))
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "pipeline"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            session, body = await opened(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise Refused(400, "messages: a non-empty list of {role, content} is needed")
            try:
                text = session.tok.apply_chat_template(messages, tools=body.get("tools"), add_generation_prompt=True,
                                                       chat_template=self.chat_template, tokenize=False)
            except Exception as e:
                raise Refused(400, f"messages: the model's chat template cannot render them ({type(e).__name__}: "
                                   f"{e})") from None
            ids = session.extend(text)
            out = await session.complete(ids, _max_tokens(body))
            message = {"role": "assistant", "content": session.tok.decode(out.token_ids, skip_special_tokens=True)}
            finish = _finish(out.finish_reason)
            if body.get("tools") and body.get("tool_choice") != "none" and self.tool_calls is not None:
                content, calls = self.tool_calls.read(session.tok, turn_text(session.tok, out.token_ids),
                                                      body["tools"])
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.model_dump() for c in calls]}
                    finish = "tool_calls"
            return _response("chat.completion", body, out, len(ids),
                             {"index": 0, "message": message, "finish_reason": finish})

        @app.post("/v1/completions")
        async def completions(request: Request):
            session, body = await opened(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = session.extend(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = prompt
            else:
                raise Refused(400, "prompt: one string or one list of token ids")
            out = await session.complete(ids, _max_tokens(body))
            text = session.tok.decode(out.token_ids, skip_special_tokens=True)
            return _response("text_completion", body, out, len(ids),
                             {"index": 0, "text": text, "finish_reason": _finish(out.finish_reason)})

        return app


def _check_params(body: dict, sampling: P.Sampling) -> None:
    """Refuse what this endpoint would not do as asked (rather than do something else silently)."""
    if body.get("n", 1) != 1:
        raise Refused(400, "n: one completion per call (each sample of the group is a session of its own)")
    if body.get("stream"):
        raise Refused(400, "stream: not supported")
    if body.get("stop"):
        raise Refused(400, "stop: not supported (the model's own end of turn ends a completion)")
    for name, run in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        value = body.get(name)
        if value is not None and value != run:
            raise Refused(400, f"{name}: {value} differs from the run's sampling.{name} ({run}), which the learner "
                               "corrects for; leave it out")


def _max_tokens(body: dict) -> int | None:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    if value is not None and (not isinstance(value, int) or value < 1):
        raise Refused(400, f"max_tokens: {value!r} is not a positive integer")
    return value


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _response(kind: str, body: dict, out, prompt_tokens: int, choice: dict) -> dict:
    return {"id": f"{kind.split('.')[0]}-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()),
            "model": body.get("model", "policy"), "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
                      "total_tokens": prompt_tokens + len(out.token_ids)}}


def _server(app) -> "uvicorn.Server":
    """uvicorn's server of `app` on a free local port, without signal handlers of its own: the generator's stay.
    uvicorn up to 0.28 installed them in `install_signal_handlers`; later ones replace SIGINT's and SIGTERM's for as
    long as `serve` runs (`capture_signals`), so a SIGTERM, the generator's drain, also stopped the endpoint that the
    agents of the groups still draining talk to."""
    import uvicorn

    class Server(uvicorn.Server):
        def install_signal_handlers(self) -> None:
            pass

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                 lifespan="off"))
