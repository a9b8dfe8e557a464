"""The agent strategy (generator/agent.py) and its OpenAI-compatible endpoint (generator/endpoint.py), driven by the
`openai` client over real HTTP, with SmolLM2's tokenizer and chat template and a scripted engine (the loop around the
engine; tests/integration/test_agent.py runs vLLM). What they must hold: the trained ids are the sampled ids, a tool's
reply is out of the loss, a re-rendered history splits the trajectory (counted), each turn keeps its version, a hung
agent ends at its timeout, and the endpoint refuses calls without the session's key or after it ended."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import sys
import time
from types import SimpleNamespace

import pytest

from generator.agent import AgentFailed, AgentRollout
from generator.engine import Completion
from generator.rollout import Context, encode_group, score_group
from learner.batching import build_rows
from pipeline import protocol as P
from pipeline.config import config_from_dict
from pipeline.tasks import load_reward_fns

pytestmark = pytest.mark.asyncio


@pytest.fixture
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


class ScriptedEngine:
    """Answers each call with the next scripted reply, sampled "under" the engine's current version; records the
    prompts it was given and what it sampled."""

    def __init__(self, tok, replies: list[str], versions=None, delay: float = 0.0):
        self.tok, self.replies, self.delay = tok, iter(replies), delay
        self.versions = iter(versions or itertools.repeat(3))
        self.version = 3
        self.prompts, self.sampled, self.seeds = [], [], []

    async def generate(self, prompt_ids, n, sampling, seed=None, stop=()):
        self.seeds.append(seed)
        await asyncio.sleep(self.delay)
        reply = next(self.replies)  # a list: its pieces tokenized apart, as a model may sample a word in two tokens
        pieces = reply if isinstance(reply, list) else [reply]
        ids = [t for p in pieces for t in self.tok(p, add_special_tokens=False)["input_ids"]] + [self.tok.eos_token_id]
        ids = ids[:sampling.max_tokens]
        v = next(self.versions)
        self.prompts.append(list(prompt_ids))
        self.sampled.append(ids)
        return [Completion(ids, [-0.5] * len(ids), "stop", v, v, 1.0)]


def _cfg(**generator):
    return config_from_dict({"sampling": {"max_tokens": 128},
                             "generator": {"rollout": "builtin:agent", "max_model_len": 1024, **generator}})


def _ctx(tok, cfg, n=1):
    item = P.PromptItem(0, 0, "", messages=[{"role": "user", "content": "What is 17 + 25?"}], columns={"answer": "42"})
    return Context(n, P.Sampling(cfg.sampling.max_tokens, 1.0), tok, item)


def _prompt(tok, ctx):
    return tok.apply_chat_template(ctx.item.messages, add_generation_prompt=True, tokenize=True, return_dict=False)


USAGE = []  # tool_agent's calls: the prompt tokens the endpoint reported


async def tool_agent(client, item):
    """An ordinary openai program: ask, run the tool the model asked for, send its reply, ask twice more."""
    messages = list(item.messages)
    for tool_reply in ("calculator: 42", "calculator: checked", None):
        r = await client.chat.completions.create(model="policy", messages=messages)
        USAGE.append(r.usage.prompt_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        if tool_reply:
            messages.append({"role": "user", "content": tool_reply})
    return messages[-1]["content"]


ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALLED = []  # function_agent's first reply


async def function_agent(client, item):
    """OpenAI function calling, as agent frameworks do it: offer a tool, run the call the reply makes, send its result
    back as a tool message, ask again."""
    messages = list(item.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    CALLED.append(first.choices[0])
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
    return second.choices[0].message.content


async def editing_agent(client, item):
    """Rewrites its history between turns (drops the model's first answer): the context no longer extends."""
    first = await client.chat.completions.create(model="policy", messages=list(item.messages))
    messages = list(item.messages) + [{"role": "assistant", "content": "(summarised) " +
                                       first.choices[0].message.content}, {"role": "user", "content": "Go on."}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return second.choices[0].message.content


async def hanging_agent(client, item):
    await client.chat.completions.create(model="policy", messages=list(item.messages))
    await asyncio.sleep(3600)


STARTED = itertools.count()


async def one_raises(client, item):
    """The first sample's agent raises at once; the others would run for an hour."""
    if next(STARTED) == 0:
        raise RuntimeError("the tool crashed")
    await asyncio.sleep(3600)


KEPT = []  # what refusing_agent saw


async def refusing_agent(client, item):
    """Calls without its key and keeps its client for after the session."""
    import openai

    bare = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        await bare.chat.completions.create(model="policy", messages=list(item.messages))
    KEPT.append((str(client.base_url), client.api_key, e.value.status_code))
    return "done"


async def test_three_calls_with_a_tool_reply_train_the_sampled_ids_and_leave_the_tool_out(tok):
    cfg = _cfg(agent=f"{__name__}:tool_agent")
    # "ans" "wer": not how the tokenizer writes "answer" (one token), so text tokenized again would not match
    engine = ScriptedEngine(tok, [["I will use the calculator for the ans", "wer."], "The sum is 42.", "42"],
                            versions=[3, 3, 4])
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    USAGE.clear()
    try:
        prompt = _prompt(tok, ctx)
        (traj,) = await rollout(engine, prompt, ctx)
    finally:
        await rollout.aclose()
    assert traj.prompt_ids is None and engine.prompts[0] == prompt  # the leased prompt, as the hub tokenised it
    assert USAGE == [len(p) for p in engine.prompts]  # each call's own prompt, as the response's usage says
    assert traj.text == "42" and traj.trajectory == 0
    # the model's tokens are exactly what it sampled, in order, and only they are trained
    sampled = [t for t, m in zip(traj.token_ids, traj.mask, strict=True) if m]
    assert sampled == [t for s in engine.sampled for t in s]
    # each call's prompt is the context so far followed by the tool's text: never the sampled ids tokenized again
    for k in (1, 2):
        assert engine.prompts[k][:len(engine.prompts[k - 1]) + len(engine.sampled[k - 1])] == \
            engine.prompts[k - 1] + engine.sampled[k - 1]
    tool = [t for t, m in zip(traj.token_ids, traj.mask, strict=True) if not m]
    assert "calculator: 42" in tok.decode(tool) and "calculator: checked" in tok.decode(tool)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.mask, strict=True) if not m)
    # each turn with its own version; the oldest is the sample's
    assert [v for _, v in traj.turns] == [3, 3, 4] and (traj.first_version, traj.last_version) == (3, 4)
    assert [traj.mask[start] for start, _ in traj.turns] == [1, 1, 1]
    # through the wire and the learner: one row, the same ids, the tool masked
    group = _encoded([traj, traj.__class__(**{**traj.__dict__, "trajectory": 1, "text": "0"})], ctx, prompt, cfg)
    assert P.unpack_ints(group.samples[0].turns).tolist() == [x for turn in traj.turns for x in turn]
    rows, stats = build_rows([group], 4, True)
    assert [s.reward for s in group.samples] == [1.0, 0.0]
    assert rows[0].completion.tolist() == traj.token_ids and rows[0].mask.tolist() == traj.mask
    assert stats["agent/splits"] == 0 and stats["agent/turns"] == 6 and stats["agent/version_changes"] == 2


async def test_a_tool_call_is_returned_as_openai_tool_calls_and_its_result_extends_the_context(tok):
    """The endpoint reads a turn's tool call with vLLM's parser (generator.tool_parser) for a request that offers
    tools; the agent's history with that call and the tool's result re-renders to the sampled text, so the trajectory
    does not split."""
    cfg = _cfg(agent=f"{__name__}:function_agent", chat_template="configs/templates/smollm2-tools.jinja")
    engine = ScriptedEngine(tok, ['<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>',
                                  "The sum is 42."])
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    CALLED.clear()
    try:
        (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
    finally:
        await rollout.aclose()
    (choice,) = CALLED
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "add"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 17, "b": 25}
    assert traj.text == "The sum is 42." and traj.prompt_ids == engine.prompts[0]  # one part: no split
    assert "<tools>" in tok.decode(engine.prompts[0])
    assert [t for t, m in zip(traj.token_ids, traj.mask, strict=True) if m] == engine.sampled[0] + engine.sampled[1]
    assert "<tool_response>\n42\n</tool_response>" in tok.decode([t for t, m in zip(traj.token_ids, traj.mask,
                                                                                      strict=True) if not m])


async def test_groups_that_start_the_endpoint_together_all_reach_it(tok):
    """The first use starts the server: the groups of a lease arrive at once and every one waits for it (found by the
    integration test, where a second group's agents called port 0 while the first group's start was under way)."""
    cfg = _cfg(agent=f"{__name__}:tool_agent")
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg, n=3)
    try:
        groups = await asyncio.gather(*(rollout(ScriptedEngine(tok, ["42"] * 9), _prompt(tok, ctx), ctx)
                                        for _ in range(2)))
    finally:
        await rollout.aclose()
    for outs in groups:
        assert [o.trajectory for o in outs] == [0, 1, 2] and all(len(o.turns) == 3 for o in outs)
        assert not any(o.finish_reason.startswith("agent_") for o in outs)


async def test_a_sigterm_while_the_endpoint_serves_is_the_generators_and_the_endpoint_goes_on():
    """The generator drains on SIGTERM (its handler on the loop); uvicorn >= 0.29 replaced SIGINT's and SIGTERM's
    handlers while it served, so the drain also stopped the endpoint the draining groups' agents talk to."""
    import os
    import signal
    import urllib.request

    from generator.endpoint import Endpoint

    loop, heard = asyncio.get_running_loop(), asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, heard.set)
    endpoint = Endpoint()
    try:
        await endpoint.start()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(heard.wait(), 5)
        await asyncio.sleep(0.3)  # a server told to exit is gone by now
        assert endpoint.server is not None and not endpoint.server.should_exit
        url = endpoint.base_url + "/models"

        def get() -> int:
            try:
                return urllib.request.urlopen(url, timeout=5).status
            except urllib.error.HTTPError as e:
                return e.code

        assert await asyncio.to_thread(get) in (200, 401, 404)  # it answers (a key is needed, or no such route)
    finally:
        await endpoint.stop()
        loop.remove_signal_handler(signal.SIGTERM)


async def test_a_history_rewritten_between_turns_splits_the_trajectory_and_counts_it(tok):
    cfg = _cfg(agent=f"{__name__}:editing_agent")
    engine = ScriptedEngine(tok, ["Seventeen and twenty-five.", "42"])
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    try:
        prompt = _prompt(tok, ctx)
        first, second = await rollout(engine, prompt, ctx)
    finally:
        await rollout.aclose()
    assert first.token_ids == engine.sampled[0] and second.token_ids == engine.sampled[1]
    assert first.prompt_ids is None and second.prompt_ids == engine.prompts[1]  # the context it was sampled from
    assert first.trajectory == second.trajectory == 0 and first.text == second.text == "42"
    other = first.__class__(**{**first.__dict__, "trajectory": 1, "text": "0"})
    group = _encoded([first, second, other], ctx, prompt, cfg)
    assert [s.reward for s in group.samples] == [1.0, 1.0, 0.0]  # the split shares its trajectory's reward
    rows, stats = build_rows([group], 3, True)
    assert stats["agent/splits"] == 1 and len(rows) == 3
    assert rows[1].prompt.tolist() == engine.prompts[1] and rows[1].advantage == rows[0].advantage > 0


async def test_a_hanging_agent_ends_at_its_timeout_and_its_sample_scores_zero(tok):
    cfg = _cfg(agent=f"{__name__}:hanging_agent", agent_timeout_s=1.0)
    engine = ScriptedEngine(tok, ["Let me think."])
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    try:
        (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
        assert traj.finish_reason == "agent_timeout" and traj.token_ids == engine.sampled[0]
        assert not rollout.endpoint.sessions  # its session closed
        group = _encoded([traj, traj.__class__(**{**traj.__dict__, "finish_reason": "stop", "text": "42",
                                                  "trajectory": 1})], ctx,
                         _prompt(tok, ctx), cfg)
        assert [s.reward for s in group.samples] == [0.0, 1.0]
        requeue = AgentRollout(_cfg(agent=f"{__name__}:hanging_agent", agent_timeout_s=1.0,
                                    agent_failure="requeue"))
        with pytest.raises(AgentFailed, match="agent_timeout"):  # the whole group, and its other sessions end
            await requeue(ScriptedEngine(tok, ["Let me think."] * 3), _prompt(tok, ctx), _ctx(tok, cfg, n=3))
        assert not requeue.endpoint.sessions and len(requeue.endpoint.ended) == 3
        await requeue.aclose()
    finally:
        await rollout.aclose()


class SlowOpenAI:
    """An import hook: importing the openai package takes 1.5 s, as it took 0.9 s in a fresh agent worker's process
    on a slow core (the import is a first sample's; a test's process has usually made it already)."""

    def find_spec(self, name, path=None, target=None):
        if name == "openai":
            time.sleep(1.5)
        return None  # found by the finders after this one


async def test_a_first_sample_pays_the_clients_import_before_its_agents_timeout_starts(tok, monkeypatch):
    for name in [m for m in sys.modules if m == "openai" or m.startswith("openai.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [SlowOpenAI(), *sys.meta_path])
    cfg = _cfg(agent=f"{__name__}:hanging_agent", agent_timeout_s=1.0)
    engine = ScriptedEngine(tok, ["Let me think."])
    rollout, ctx = AgentRollout(cfg, worker=True), _ctx(tok, cfg)  # as in an agent worker: no tool parser yet
    try:
        (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
    finally:
        await rollout.aclose()
    # its one call made and recorded within the second: the timeout cut the hang, not the import
    assert traj.finish_reason == "agent_timeout" and engine.sampled and traj.token_ids == engine.sampled[0]


async def test_under_requeue_one_failed_agent_ends_its_whole_group_at_once(tok):
    cfg = _cfg(agent=f"{__name__}:one_raises", agent_timeout_s=600.0, agent_failure="requeue")
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg, n=3)
    try:
        with pytest.raises(AgentFailed, match="agent_error: RuntimeError: the tool crashed"):
            await asyncio.wait_for(rollout(ScriptedEngine(tok, []), _prompt(tok, ctx), ctx), 30)
        assert not rollout.endpoint.sessions and len(rollout.endpoint.ended) == 3  # the other two stopped with it
    finally:
        await rollout.aclose()


async def test_a_command_agent_gets_its_session_and_a_hung_one_is_killed_at_the_timeout(tok, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys, time\nfrom openai import OpenAI\n"
        "item = json.load(sys.stdin)\n"
        "client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment\n"
        "r = client.chat.completions.create(model='policy', messages=item['messages'])\n"
        "if os.environ.get('HANG'):\n    open(os.environ['HANG'], 'w').write(str(os.getpid())); time.sleep(3600)\n"
        "print(r.choices[0].message.content + ' / ' + item['columns']['answer'])\n")
    cfg = _cfg(agent_command=[sys.executable, str(script)], agent_timeout_s=20.0)
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    try:
        engine = ScriptedEngine(tok, ["42"])
        (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
        assert traj.text == "42 / 42" and traj.token_ids == engine.sampled[0]
        pid_file = tmp_path / "pid"
        rollout.timeout = 10.0
        import os

        os.environ["HANG"] = str(pid_file)
        try:
            (traj,) = await rollout(ScriptedEngine(tok, ["hm"]), _prompt(tok, ctx), ctx)
        finally:
            del os.environ["HANG"]
        assert traj.finish_reason == "agent_timeout"
        with pytest.raises(ProcessLookupError):  # killed by its process id
            os.kill(int(pid_file.read_text()), 0)
    finally:
        await rollout.aclose()


async def test_the_endpoint_refuses_calls_without_the_session_key_and_after_the_session(tok):
    import openai

    cfg = _cfg(agent=f"{__name__}:refusing_agent")
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    KEPT.clear()
    try:
        await rollout(ScriptedEngine(tok, []), _prompt(tok, ctx), ctx)
        (url, key, status), = KEPT
        assert status == 401
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:  # its own key, after the session ended
            await client.chat.completions.create(model="policy", messages=list(ctx.item.messages))
        assert e.value.status_code == 410
        session = rollout.endpoint.open(ScriptedEngine(tok, []), tok, ctx.sampling)
        bound = openai.AsyncOpenAI(base_url=rollout.endpoint.base_url, api_key=session.key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="temperature"):  # not the run's sampling
            await bound.chat.completions.create(model="policy", messages=list(ctx.item.messages), temperature=0.2)
        import httpx

        async with httpx.AsyncClient() as http:  # not JSON: refused, named
            r = await http.post(f"{rollout.endpoint.base_url}/chat/completions", content=b"{not json",
                                headers={"Authorization": f"Bearer {session.key}"})
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
        assert session.calls == 0 and not session.parts  # nothing recorded
    finally:
        await rollout.aclose()


def _encoded(outs, ctx, prompt, cfg) -> P.RolloutGroup:
    """The group as the hub receives it: scored by the run's reward, encoded, decoded, checked."""
    ctx = SimpleNamespace(**{**ctx.__dict__, "n": len({o.trajectory for o in outs})})
    rewards = load_reward_fns(config_from_dict({"rewards": [{"fn": "builtin:math_answer"}]}).rewards)
    scores = score_group(outs, ctx, rewards, 10)
    lease = SimpleNamespace(lease_id=1, sampling=P.Sampling(128, 1.0))
    group, _ = P.decode(encode_group(outs, ctx, lease, prompt, scores, "g", "s"))
    P.check_shape(group, ctx.n)
    return group


async def test_the_shipped_calculator_agent_puts_the_tools_result_in_the_context_out_of_the_loss(tok):
    """generator/calculator_agent.py (configs/gpu-smollm2-agent.yaml) on a builtin:arith row: the model's sum is
    wrong, the calculator's reply corrects it, the final answer is scored."""
    from pipeline.tasks import arith_rows

    row = arith_rows(1, 0)[0]  # What is 5 + 2?
    cfg = _cfg(agent="builtin:calculator_agent")
    ctx = Context(1, P.Sampling(256, 1.0), tok, P.PromptItem(0, 0, "", columns={"answer": row["answer"]},
                                                               messages=row["prompt"]))
    engine = ScriptedEngine(tok, ["5 + 2 = 8\n#### 8", "#### 7"])
    rollout = AgentRollout(cfg)
    try:
        (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
    finally:
        await rollout.aclose()
    tool = tok.decode([t for t, m in zip(traj.token_ids, traj.mask, strict=True) if not m])
    assert "Calculator: 5 + 2 = 7" in tool and traj.text == "#### 7" and len(traj.turns) == 2
    math = config_from_dict({"rewards": [{"fn": "builtin:math_answer"}]}).rewards
    scores = score_group([traj], ctx, load_reward_fns(math), 10)
    assert scores[0] == [1.0]


async def _post(rollout, session, path: str, body: dict | bytes):
    import httpx

    async with httpx.AsyncClient(base_url=rollout.endpoint.base_url, timeout=30) as http:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        return await http.post(path, headers={"Authorization": f"Bearer {session.key}"}, **kw)


async def test_the_endpoint_refuses_every_field_it_would_not_honour_naming_it_and_takes_neutral_values(tok):
    """Sampling and format fields that differ from what the run does, and fields it does not know, are refused (400)
    with the field named, not answered with something else; a limit of 0 or true is no limit."""
    cfg = _cfg(agent=f"{__name__}:tool_agent")
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    await rollout.endpoint.start()
    engine = ScriptedEngine(tok, ["42"] * 8)
    session = rollout.endpoint.open(engine, tok, ctx.sampling)
    messages = list(ctx.item.messages)
    refused = [("top_k", 5), ("frequency_penalty", 0.5), ("presence_penalty", 1), ("logit_bias", {"42": 5}),
               ("seed", 1), ("response_format", {"type": "json_object"}), ("logprobs", True), ("min_p", 0.1),
               ("tool_choice", "required"), ("parallel_tool_calls", False), ("max_completion_tokens", 0),
               ("max_tokens", True), ("temperature", True), ("n", 2), ("top_p", 0.5), ("frobnicate", 1)]
    try:
        for name, value in refused:
            r = await _post(rollout, session, "/chat/completions", {"messages": messages, name: value})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{name}:"), (name, r.text)
        r = await _post(rollout, session, "/completions", {"prompt": "Hi", "echo": True})
        assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
        assert engine.prompts == [] and session.calls == 0  # nothing reached the engine
        neutral = {"model": "any", "temperature": 1, "top_p": 1.0, "top_k": -1, "seed": None, "n": 1, "stop": [],
                   "stream": False, "tool_choice": "auto", "logprobs": False, "max_completion_tokens": 8,
                   "max_tokens": 8, "user": "u", "frequency_penalty": 0}
        r = await _post(rollout, session, "/chat/completions", {"messages": messages, **neutral})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "42"
    finally:
        rollout.endpoint.close(session)
        await rollout.aclose()


async def test_prompt_ids_outside_the_vocabulary_a_prompt_past_the_context_and_a_huge_body_are_refused(tok):
    """One bad id killed the engine (the embedding's IndexError, every group in flight lost); a prompt the context
    cannot hold is named before the engine; a body past the limit is refused (413) before it is read whole."""
    cfg = _cfg(agent=f"{__name__}:tool_agent")
    rollout, ctx = AgentRollout(cfg), _ctx(tok, cfg)
    await rollout.endpoint.start()
    engine = ScriptedEngine(tok, ["42"])
    session = rollout.endpoint.open(engine, tok, ctx.sampling)
    try:
        for ids, why in (([1, -1, 2], "not in the model's vocabulary"), ([1, len(tok)], "not in the model's voc"),
                         ([1, True], "one string or one list of token ids"),
                         ([1] * cfg.generator.max_model_len, "generator.max_model_len=1024")):
            r = await _post(rollout, session, "/completions", {"prompt": ids})
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        huge = json.dumps({"messages": [{"role": "user", "content": "x" * rollout.endpoint.max_body}]}).encode()
        r = await _post(rollout, session, "/chat/completions", huge)
        assert r.status_code == 413 and "more than this endpoint takes" in r.json()["error"]["message"]
        assert engine.prompts == [] and session.calls == 0
        r = await _post(rollout, session, "/completions", {"prompt": [1, 2, 3]})
        assert r.status_code == 200 and engine.prompts == [[1, 2, 3]]
    finally:
        rollout.endpoint.close(session)
        await rollout.aclose()


class ThreadsSeen:
    """SmolLM2's tokenizer, noting the thread of each call that renders or tokenizes text."""

    def __init__(self, tok):
        self.tok, self.threads = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)

    def __call__(self, *args, **kwargs):
        import threading

        self.threads.append(threading.current_thread())
        return self.tok(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        import threading

        self.threads.append(threading.current_thread())
        return self.tok.apply_chat_template(*args, **kwargs)


async def test_a_large_request_is_rendered_and_tokenized_off_the_event_loop(tok):
    """A 10 MB message took 12 s to tokenize on the generator's loop, which also runs its heartbeats (15 s timeout).
    A small one is done on the loop: a thread's hand-off would cost more than the work."""
    import threading

    from generator.endpoint import INLINE_BYTES

    cfg = _cfg(agent=f"{__name__}:tool_agent", max_model_len=8192)
    rollout, ctx, seen = AgentRollout(cfg), _ctx(tok, cfg), ThreadsSeen(tok)
    await rollout.endpoint.start()
    session = rollout.endpoint.open(ScriptedEngine(tok, ["42", "43"]), seen, ctx.sampling)
    try:
        big = [{"role": "user", "content": "seventeen plus twenty-five " * (INLINE_BYTES // 20)}]
        r = await _post(rollout, session, "/chat/completions", {"messages": big})
        assert r.status_code == 200 and len(seen.threads) >= 2  # rendered, then tokenized
        assert threading.main_thread() not in seen.threads
        seen.threads.clear()
        r = await _post(rollout, session, "/chat/completions", {"messages": list(ctx.item.messages)})
        assert r.status_code == 200 and set(seen.threads) == {threading.main_thread()}
    finally:
        rollout.endpoint.close(session)
        await rollout.aclose()


async def test_a_seeded_groups_calls_each_get_a_seed_of_their_own_and_the_same_each_time(tok):
    """sampling.seed: each call of each sample is seeded from the group's seed (generator/rollout.py seed_of), so a
    run repeats what it sampled; no two calls share a seed (two samples of one prompt would sample alike). Unseeded,
    the engine's own seed: no per-request seed at all."""
    cfg = _cfg(agent=f"{__name__}:tool_agent")
    seeds = []
    for group_seed in (123, 123, 124, None):
        engine, rollout = ScriptedEngine(tok, ["a", "b", "c"] * 2), AgentRollout(cfg)
        ctx = dataclasses.replace(_ctx(tok, cfg, n=2), seed=group_seed)
        try:
            await rollout(engine, _prompt(tok, ctx), ctx)
        finally:
            await rollout.aclose()
        seeds.append(sorted(engine.seeds, key=str))
    assert len(seeds[0]) == 6 and len(set(seeds[0])) == 6 and None not in seeds[0]
    assert seeds[0] == seeds[1] and not set(seeds[0]) & set(seeds[2]) and seeds[3] == [None] * 6
