"""An OpenAI-compatible endpoint on a generator's engine: one session per sample of an agent (generator/agent.py).

    POST /v1/chat/completions   messages (and tools) through the chat template; a turn's tool calls as OpenAI's
                                tool_calls, read by vLLM's parser (generator.tool_parser)
    POST /v1/completions        a prompt as text or token ids
    GET  /v1/models

FastAPI served by uvicorn on the generator's own event loop, bound to 127.0.0.1 on a free port; an agent callable's
openai client calls the same app in-process (`in_process_http`). Every request carries its session's key
(`Authorization: Bearer KEY`, which the openai client sends as its api_key); a request without one, with an unknown
one, or for a session that has ended is refused (401, 410). What the endpoint would not do as asked it refuses (400,
the field named) rather than do something else: sampling is the lease's (temperature, top_p), the behaviour policy the
learner corrects for, so any sampling or format field that would change it (top_k, penalties, logit_bias, seed,
response_format, logprobs, tool_choice other than auto or none, n > 1, streaming, stop strings) and any field it does
not know are refused (the tables CHAT and TEXT). A prompt of token ids outside the vocabulary or too long for
generator.max_model_len is refused before the engine; a body past `max_body` bytes is refused (413); a body past
INLINE_BYTES is rendered and tokenized off the event loop, which also runs the generator's heartbeats.

What a session records, its exact tokens and parts: generator/agent_sessions.py.
A turn's tool calls: generator/toolcalls.py.

(No `from __future__ import annotations` here: FastAPI reads the routes' annotations, and `Request` is imported where
the app is made.)
"""

import asyncio
import contextlib
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from generator.agent_sessions import Refused, Session
from generator.toolcalls import ToolCalls, turn_text
from pipeline import protocol as P

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)
ENDED = 4096  # ended sessions whose keys are remembered (their late calls told so, not just refused)
# a request body's bytes, at most: these plus as many per token of generator.max_model_len (a longer body cannot fit
# the context; unbounded, a 10 MB message took 12 s of the generator's CPU to tokenize)
MAX_BODY, BODY_BYTES_PER_TOKEN = 2**20, 64
INLINE_BYTES = 8192  # a body this small is rendered and tokenized on the loop (under 5 ms); a thread hop cost more


class Endpoint:
    """The generator's endpoint: sessions by key, and the server (started on first use, on the running loop)."""

    def __init__(self, model_name: str = "policy", chat_template: str | None = None,
                 tool_calls: ToolCalls | None = None, max_model_len: int = 0):
        self.model_name, self.chat_template = model_name, chat_template  # None: the tokenizer's own
        self.tool_calls = tool_calls  # reads the calls of a request that offers tools
        self.max_model_len = max_model_len  # a prompt as long is refused (400) before it reaches the engine
        self.max_body = MAX_BODY + BODY_BYTES_PER_TOKEN * max_model_len  # bytes; a longer body is refused (413)
        self.sessions: dict[str, Session] = {}
        self.ended: dict[str, None] = {}  # keys of the latest sessions that ended, oldest first
        self.server: uvicorn.Server | None = None
        self.asgi: Any = None  # the app the server serves, also called in-process (`in_process_http`)
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
        self.asgi = self.app()
        self.server = server = _server(self.asgi)
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

    def open(self, engine, tokenizer, sampling: P.Sampling, seed: int | None = None) -> Session:
        key = secrets.token_urlsafe(24)
        self.sessions[key] = session = Session(key, engine, tokenizer, sampling, self.max_model_len, seed)
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

        async def opened(request: Request) -> tuple[Session, dict, bool]:
            """A completion request's session (by its key), body, and whether the body is small (INLINE_BYTES),
            refused where either is wrong."""
            session = self.session(request.headers.get("authorization"))
            raw = await _body(request, self.max_body)
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise Refused(400, f"the request body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise Refused(400, "the request body must be a JSON object")
            _check_params(body, session.sampling, CHAT if request.url.path.endswith("/chat/completions") else TEXT)
            return session, body, len(raw) <= INLINE_BYTES

        @app.get("/v1/models")
        async def models(request: Request):
            self.session(request.headers.get("authorization"))
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "pipeline"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            session, body, small = await opened(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise Refused(400, "messages: a non-empty list of {role, content} is needed")

            def render() -> str:
                try:
                    return session.tok.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                                           add_generation_prompt=True, chat_template=self.chat_template)
                except Exception as e:
                    raise Refused(400, f"messages: the model's chat template cannot render them ({type(e).__name__}: "
                                       f"{e})") from None

            ids, out = await session.complete_text(render, _max_tokens(body), inline=small)
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
            session, body, small = await opened(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                text = prompt
                ids, out = await session.complete_text(lambda: text, _max_tokens(body), inline=small)
            elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                vocabulary = len(session.tok)
                wrong = [t for t in prompt if not 0 <= t < vocabulary]
                if wrong:
                    raise Refused(400, f"prompt: token ids {wrong[:5]} are not in the model's vocabulary "
                                       f"(0 to {vocabulary - 1})")
                ids, out = prompt, await session.complete(prompt, _max_tokens(body))
            else:
                raise Refused(400, "prompt: one string or one list of token ids")
            text = session.tok.decode(out.token_ids, skip_special_tokens=True)
            return _response("text_completion", body, out, len(ids),
                             {"index": 0, "text": text, "finish_reason": _finish(out.finish_reason)})

        return app


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is(*values):
    """A field's test: its value is one of `values` (or the field is absent, None)."""
    return lambda value, sampling: value is None or any(value == v and type(value) is type(v) or
                                                        _number(v) and _number(value) and value == v for v in values)


def _run_value(name: str):
    """A field's test: absent, or the run's own sampling.<name> (the behaviour policy the learner corrects for)."""
    return lambda value, sampling: value is None or _number(value) and value == getattr(sampling, name)


def _positive(value, sampling) -> bool:
    return value is None or type(value) is int and value >= 1


ANY = lambda value, sampling: True  # noqa: E731 -- a field that changes nothing this endpoint does
# What each route honours: a field not named here, or with a value its test refuses, is refused (400), named, rather
# than silently ignored. The values accepted are those that change nothing: sampling is the run's, one completion, no
# stop strings, no streaming; the tests' texts say what is accepted.
COMMON = {
    "model": (ANY, "any name"), "user": (ANY, "any"),
    "max_tokens": (_positive, "a positive integer"),
    "n": (_is(1), "1: each sample of the group is a session of its own"),
    "stream": (_is(False), "false: not supported"),
    "stop": (_is("", []), "none: the model's own end of turn ends a completion"),
    "temperature": (_run_value("temperature"), "the run's sampling.temperature, which the learner corrects for"),
    "top_p": (_run_value("top_p"), "the run's sampling.top_p, which the learner corrects for"),
    "ignore_eos": (lambda v, s: v is None or v is s.ignore_eos, "the run's sampling.ignore_eos"),
    "top_k": (_is(-1, 0), "-1 or 0 (off): the run samples the whole vocabulary"),
    "min_p": (_is(0), "0 (off)"), "repetition_penalty": (_is(1), "1 (off)"),
    "frequency_penalty": (_is(0), "0 (off)"), "presence_penalty": (_is(0), "0 (off)"),
    "logit_bias": (_is({}), "none: the learner trains the model's own distribution"),
    "seed": (_is(), "none: the run seeds its engines"),
}
CHAT = COMMON | {
    "messages": (ANY, "a list of messages"), "tools": (ANY, "a list of tools"), "metadata": (ANY, "any"),
    "max_completion_tokens": (_positive, "a positive integer"),
    "tool_choice": (_is("auto", "none"), "auto or none: the model chooses (required or a named tool is not "
                                         "honoured)"),
    "parallel_tool_calls": (_is(True), "true: the parser returns every call a turn makes"),
    "response_format": (_is({"type": "text"}), "text: no guided decoding"),
    "logprobs": (_is(False), "false: not returned"), "top_logprobs": (_is(), "none: not returned"),
    "store": (_is(False), "false"), "stream_options": (_is(), "none: not streamed"),
}
TEXT = COMMON | {
    "prompt": (ANY, "text or token ids"), "echo": (_is(False), "false"), "suffix": (_is(), "none"),
    "best_of": (_is(1), "1"), "logprobs": (_is(), "none: not returned"),
}


def _check_params(body: dict, sampling: P.Sampling, fields: dict) -> None:
    """Refuse what this endpoint would not do as asked (rather than do something else silently)."""
    for name, value in body.items():
        if name not in fields:
            raise Refused(400, f"{name}: not a field this endpoint honours; leave it out")
        test, accepted = fields[name]
        if not test(value, sampling):
            raise Refused(400, f"{name}: {json.dumps(value)[:80]} is not honoured here; accepted: {accepted}")
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
        raise Refused(400, "max_tokens and max_completion_tokens differ: send one")


def _max_tokens(body: dict) -> int | None:
    """The completion's own limit (checked by _check_params), None where absent."""
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


async def _body(request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes before more is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"the request body is {declared} bytes, more than this endpoint takes ({limit}, for "
                           f"generator.max_model_len tokens of context)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Refused(413, f"the request body is more than {limit} bytes, more than this endpoint takes (for "
                               f"generator.max_model_len tokens of context)")
    return bytes(body)


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _response(kind: str, body: dict, out, prompt_tokens: int, choice: dict) -> dict:
    return {"id": f"{kind.split('.')[0]}-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()),
            "model": body.get("model", "policy"), "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.token_ids),
                      "total_tokens": prompt_tokens + len(out.token_ids)}}


def in_process_http(app) -> Any:
    """An HTTP client for the openai client of an agent in this process: it calls the endpoint's app directly (no
    socket, no server parsing; the same routes, keys and refusals) and serves every sample's client. On a GPU host a
    client of its own per sample, over the socket, cost the endpoint 85 % of the engine's tokens/s (issue 51): an SSL
    context built each time, then the connection pool and uvicorn. The server stays up for command agents and for
    clients an agent makes itself from `client.base_url`."""
    import importlib

    from openai import DefaultAsyncHttpxClient

    # openai's own httpx (httpx2 from openai 3 on) has the transport
    base = next(c for c in DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    httpx = importlib.import_module(base.__module__.split(".")[0])
    # a failure the app's handlers answer (500) reaches the agent as a server's would, not raised in it
    return DefaultAsyncHttpxClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))


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
