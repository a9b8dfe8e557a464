"""The environment strategy (generator/environment.py): a TRL environment_factory class, unchanged, with SmolLM2's
tokenizer, the shipped Hermes-format template (configs/templates/smollm2-tools.jinja), vLLM's hermes tool parser and a
scripted engine (the loop around the engine; tests/integration/test_environment.py runs vLLM and an OpenEnv server).
What they must hold: the model's tool calls run on its own instance, their replies are in the context and out of the
loss, the trained ids are the sampled ids (the history is never rendered again), each turn keeps its version, the
environment's reward reaches the reward functions, and a bad tool call or a hung tool fails nothing else."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from types import SimpleNamespace

import pytest

from generator.environment import EnvironmentRollout, ToolThreads
from generator.rollout import score_group
from pipeline.config import ConfigError, config_from_dict
from pipeline.tasks import load_reward_fns
from pipeline.validate import check_config
from tests.unit.test_agent import ScriptedEngine, _ctx, _prompt

pytestmark = pytest.mark.asyncio
TEMPLATE = "configs/templates/smollm2-tools.jinja"


@pytest.fixture
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


class Calculator:
    """As a TRL user writes one: reset, a tool with a docstring and type hints, get_reward."""

    def __init__(self):
        self.calls, self.answer = [], None

    def reset(self, prompt=None, answer=None, **kwargs) -> str:
        self.calls, self.answer = [], answer
        return " Use the add tool."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls.append((a, b))
        return a + b

    async def slow(self, seconds: float) -> str:
        """Wait, then say so.

        Args:
            seconds: How long to wait.
        """
        await asyncio.sleep(seconds)
        return "waited"

    def get_reward(self) -> float:
        return float(any(a + b == int(self.answer) for a, b in self.calls))


def _call(name: str, **arguments) -> str:
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": arguments}) + '\n</tool_call>'


def trl_reward(environments, **kwargs):
    """A reward function as TRL's docs write one for environment_factory."""
    return [len(env.calls) for env in environments]


def _cfg(**generator):
    return config_from_dict({"sampling": {"max_tokens": 256},
                             "rewards": [{"fn": "builtin:environment_reward"}, {"fn": f"{__name__}:trl_reward"}],
                             "generator": {"rollout": "builtin:environment", "environment": f"{__name__}:Calculator",
                                           "chat_template": TEMPLATE, "max_model_len": 2048, **generator}})


async def _run(tok, cfg, replies, versions=None):
    engine = ScriptedEngine(tok, replies, versions=versions)
    rollout, ctx = EnvironmentRollout(cfg), _ctx(tok, cfg)
    try:
        (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
    finally:
        await rollout.aclose()
    return engine, ctx, traj


async def test_a_tool_call_runs_on_the_samples_instance_and_the_sampled_ids_are_trained(tok):
    cfg = _cfg()
    # the call in two pieces tokenized apart ("argu" "ments"): text tokenized again would not give these ids
    first = ['<tool_call>\n{"name": "add", "argu', 'ments": {"a": 17, "b": 25}}\n</tool_call>']
    engine, ctx, traj = await _run(tok, cfg, [first, "The sum is 42."], versions=[3, 4])
    prompt = tok.decode(engine.prompts[0])
    assert "<tools>" in prompt and '"name": "add"' in prompt and '"name": "slow"' in prompt  # the tools offered
    assert "What is 17 + 25? Use the add tool." in prompt  # reset's observation after the last message
    assert traj.prompt_ids == engine.prompts[0] and traj.text == "The sum is 42."
    env = traj.extra["environment"]
    assert env.calls == [(17, 25)]  # parsed by vLLM's hermes parser and run on this sample's own instance
    # the second turn's context is the first's, the sampled ids as they came, then the tool's reply
    assert engine.prompts[1][:len(engine.prompts[0]) + len(engine.sampled[0])] == engine.prompts[0] + engine.sampled[0]
    assert [t for t, m in zip(traj.token_ids, traj.mask, strict=True) if m] == engine.sampled[0] + engine.sampled[1]
    tool = tok.decode([t for t, m in zip(traj.token_ids, traj.mask, strict=True) if not m])
    assert "<tool_response>\n42\n</tool_response>" in tool and tool.endswith("<|im_start|>assistant\n")
    assert [v for _, v in traj.turns] == [3, 4] and (traj.first_version, traj.last_version) == (3, 4)
    # the environment's own reward, and a TRL reward function over `environments`
    other = traj.__class__(**{**traj.__dict__, "trajectory": 1, "extra": {"environment": Calculator()}})
    other.extra["environment"].reset(answer="42")
    ctx = SimpleNamespace(**{**ctx.__dict__, "n": 2})
    assert score_group([traj, other], ctx, load_reward_fns(cfg.rewards), 10) == ([2.0, 0.0], [[1.0, 1.0], [0.0, 0.0]])


async def test_between_two_turns_the_context_gets_the_tool_reply_block_and_the_generation_prompt_and_nothing_else(tok):
    """Not a stand-in's assistant turn: every later turn is trained on a context that holds what the model wrote."""
    engine, _, traj = await _run(tok, _cfg(), [_call("add", a=17, b=25), "The sum is 42."])
    first, second = engine.sampled
    between = engine.prompts[1][len(engine.prompts[0]) + len(first):]
    expected = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert between == tok(expected, add_special_tokens=False)["input_ids"], tok.decode(between)
    assert traj.token_ids == first + between + second
    assert traj.mask == [1] * len(first) + [0] * len(between) + [1] * len(second)


async def test_tool_results_json_cannot_write_are_replied_as_text_and_a_huge_reply_ends_the_episode_untokenized(tok):
    """A numpy number or a set is the reply's text (str), not a failed sample; a reply longer than the context could
    hold ends the episode at its tools without tokenizing it (10 MB took seconds of the generator's CPU)."""
    engine, _, traj = await _run(tok, _cfg(environment=f"{__name__}:Odd"), [_call("pair"), _call("many"), "done"])
    tool = tok.decode([t for t, m in zip(traj.token_ids, traj.mask, strict=True) if not m])
    assert "<tool_response>\n{1, 2}\n</tool_response>" in tool and "<tool_response>\n7\n</tool_response>" in tool
    assert traj.finish_reason == "stop" and traj.text == "done"
    cfg = _cfg(environment=f"{__name__}:Odd")
    rollout, ctx, rendered = EnvironmentRollout(cfg), _ctx(tok, cfg), []
    suffix = rollout.suffix
    rollout.suffix = lambda tok, replies, schemas: rendered.append(replies) or suffix(tok, replies, schemas)
    engine = ScriptedEngine(tok, [_call("flood"), "never asked"])
    try:
        (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
    finally:
        await rollout.aclose()
    assert len(engine.sampled) == 1 and traj.finish_reason == "stop" and traj.token_ids == engine.sampled[0]
    assert rendered == []  # the ten megabytes were never rendered or tokenized


class Odd:
    def reset(self, **kwargs) -> None:
        return None

    def pair(self) -> set:
        """A set."""
        return {1, 2}

    def many(self):
        """A numpy integer."""
        import numpy as np

        return np.int64(7)

    def flood(self) -> str:
        """Ten megabytes."""
        return "x " * 5_000_000


async def test_a_bad_tool_call_is_answered_with_its_error_and_the_episode_goes_on(tok):
    cfg = _cfg()
    replies = [_call("mul", a=2, b=3), '<tool_call>\n{"name": "add", "arguments": {"a": "x"}}\n</tool_call>', "42"]
    engine, _, traj = await _run(tok, cfg, replies)
    tool = tok.decode([t for t, m in zip(traj.token_ids, traj.mask, strict=True) if not m])
    assert "LookupError: no tool named 'mul'; the tools are add, slow" in tool
    assert "TypeError" in tool and len(engine.sampled) == 3 and traj.text == "42"
    assert traj.extra["environment"].calls == []


async def test_tool_turns_stop_at_max_tool_calls_and_the_next_turn_is_the_answer(tok):
    cfg = _cfg(max_tool_calls=2)
    engine, _, traj = await _run(tok, cfg, [_call("add", a=1, b=1)] * 5)
    assert len(engine.sampled) == 3 and traj.extra["environment"].calls == [(1, 1), (1, 1)]
    assert len(traj.turns) == 3 and traj.finish_reason == "stop"


async def test_a_hung_tool_ends_at_the_timeout_and_the_sample_scores_zero(tok):
    cfg = _cfg(agent_timeout_s=1.0)
    engine, ctx, traj = await _run(tok, cfg, [_call("slow", seconds=3600)])
    assert traj.finish_reason == "agent_timeout" and traj.token_ids == engine.sampled[0]
    assert score_group([traj], ctx, load_reward_fns(cfg.rewards), 10)[0] == [0.0]


class RefusingEngine(ScriptedEngine):
    async def generate(self, prompt_ids, n, sampling, seed=None, stop=()):
        raise ValueError(f"your prompt contains {len(prompt_ids)} input tokens, more than the model's context")


async def test_a_call_the_engine_refuses_leaves_no_part_and_a_prompt_past_max_model_len_is_named(tok, caplog):
    """A refused call's context is not sent as a sample (the hub would reject its length and quarantine the
    generator: found by the integration test). The strategy names generator.max_model_len before the engine does."""
    for cfg, why in ((_cfg(), "more than the model's context"), (_cfg(max_model_len=260), "raise generator.max_model")):
        engine = RefusingEngine(tok, [])
        rollout, ctx = EnvironmentRollout(cfg), _ctx(tok, cfg)
        try:
            (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
        finally:
            await rollout.aclose()
        assert traj.finish_reason == "agent_error" and traj.prompt_ids is None and traj.token_ids == []
        assert why in caplog.text


async def test_a_factory_without_reset_or_an_unknown_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="vLLM has no tool parser 'hermez'; it has .*hermes"):
        EnvironmentRollout(_cfg(tool_parser="hermez"))
    with pytest.raises(TypeError, match="object has no reset method"):
        EnvironmentRollout(_cfg(environment="builtins:object"))
    with pytest.raises(ConfigError, match="generator.environment: rollout builtin:environment needs"):
        check_config(_cfg(environment=""))
    with pytest.raises(ConfigError, match="generator.chat_template: 'nope.jinja' is not a file"):
        check_config(_cfg(chat_template="nope.jinja"))
    with pytest.raises(ConfigError, match="generator.environment: set, but generator.rollout is 'builtin:agent'"):
        check_config(_cfg(rollout="builtin:agent", agent=f"{__name__}:trl_reward"))


RELEASE = threading.Event()


class Blocking:
    def reset(self, **kwargs) -> None:
        return None

    def block(self) -> str:
        """Never returns (until the test lets it)."""
        RELEASE.wait()
        return "late"


async def test_hung_tools_hold_threads_of_their_own_not_the_loops_and_a_pool_they_fill_fails_loudly(tok, caplog):
    """A synchronous tool that hangs keeps its thread after its sample's timeout. On asyncio's default executor, some
    cores + 4 of them left nothing to score groups or check weight files with; on the environment's own threads they
    starve nothing else, and once they hold all of those a new call fails at once, named (not queued for ever)."""
    default = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    cfg = _cfg(environment=f"{__name__}:Blocking", agent_timeout_s=0.5)
    rollout, ctx = EnvironmentRollout(cfg), _ctx(tok, cfg)
    rollout.threads = ToolThreads(size=default + 1)

    async def episode():
        (traj,) = await rollout(ScriptedEngine(tok, [_call("block"), "done"]), _prompt(tok, ctx), ctx)
        return traj

    RELEASE.clear()
    try:
        hung = await asyncio.gather(*(episode() for _ in range(default + 1)))
        assert {t.finish_reason for t in hung} == {"agent_timeout"}
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 10) == 42  # scoring's executor is free
        assert rollout.threads.hung == default + 1
        full = await episode()
        assert full.finish_reason == "agent_error"
        assert f"all {default + 1} threads for the environment's methods still run calls given up on" in caplog.text
    finally:
        RELEASE.set()
    for _ in range(200):  # the hung calls return once released: their threads are free again
        if rollout.threads.hung == 0:
            break
        await asyncio.sleep(0.05)
    assert rollout.threads.hung == 0
    RELEASE.clear()
    engine = ScriptedEngine(tok, [_call("add", a=1, b=2), "3"])
    rollout.factory = Calculator
    (traj,) = await rollout(engine, _prompt(tok, ctx), ctx)
    assert traj.finish_reason == "stop" and traj.extra["environment"].calls == [(1, 2)]
    await rollout.aclose()
