"""TRL's dataset formats with the real CPU engine: standard (text prompts) and conversational (message lists,
the chat template applied, completions handed to reward functions as assistant messages). Reward functions copied
from TRL's documentation run unchanged, with the keyword arguments TRL passes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pipeline import protocol as P
from pipeline.config import apply_environment, config_from_dict, load_config
from pipeline.tinymodel import VOCAB, resolve_model_path
from tests.integration import trl_rewards
from tests.integration.helpers import Sink

pytestmark = pytest.mark.integration
MOD = "tests.integration.trl_rewards"
STANDARD = {"prompt": "3 1 4 1 =", "ground_truth": "3"}
CONVERSATIONAL = {"prompt": [{"role": "user", "content": "3 1 4 1"}], "ground_truth": "3"}


class Hub:
    def __init__(self):
        self.reports = []

    async def request(self, msg, timeout=None):
        self.reports.append(msg)
        return P.Ack()


def test_reward_functions_from_trls_documentation_run_unchanged_on_both_formats(model_cache):
    from transformers import AutoTokenizer

    from generator.engine import Engine
    from generator.service import Generator
    from learner.prompts import Prompts
    from pipeline.tasks import encode_prompt

    cfg = load_config(None, ["generator.max_num_seqs=8", "sampling.max_tokens=6"])
    apply_environment(cfg)
    path = resolve_model_path("builtin:tiny")
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.apply_chat_template(CONVERSATIONAL["prompt"], add_generation_prompt=True, tokenize=False) == "3 1 4 1 ="

    def item(row):  # as the learner's hub leases it
        prompts = Prompts([row], "prompt", lambda p: encode_prompt(tok, cfg.data, p), len(VOCAB), 256)
        return prompts.item(0, 0)

    standard, conversational = item(STANDARD), item(CONVERSATIONAL)
    assert P.unpack_ints(standard.prompt_ids).tolist() == [VOCAB.index(t) for t in "3 1 4 1 =".split()]
    assert conversational.prompt_ids == standard.prompt_ids and conversational.messages == CONVERSATIONAL["prompt"]

    async def rollout(rewards: list[str], it: P.PromptItem):
        gen_cfg = config_from_dict({"sampling": {"max_tokens": 6}, "rewards": [{"fn": r} for r in rewards]})
        gen = Generator(gen_cfg, engine, tok, "tcp://127.0.0.1:1")
        gen.welcome, gen.push, gen.client = SimpleNamespace(group_size=4), Sink(), Hub()
        await gen._group(P.Lease(1, 0, [it], P.Sampling(6, 1.0)), it)
        assert gen.client.reports == [], gen.client.reports  # no reward function failed
        (group,) = gen.push.sent
        texts = [tok.decode(P.unpack_ints(s.token_ids).tolist(), skip_special_tokens=True) for s in group.samples]
        return group, texts

    async def both():
        return (await rollout([f"{MOD}:reward_func", f"{MOD}:ground_truth_reward", f"{MOD}:recorded"], standard),
                trl_rewards.CALLS[-1],
                await rollout([f"{MOD}:format_reward_func", f"{MOD}:recorded"], conversational))

    engine = None
    try:
        engine = Engine(cfg, path, seed=0, eos_id=tok.eos_token_id)  # (AsyncLLM binds to the loop it first runs in)
        (group, texts), call, (conv_group, conv_texts) = asyncio.run(both())
        assert [s.rewards[:2] for s in group.samples] == [[float(len(t)), float(t[:1] == "3")] for t in texts]
        assert call["prompts"] == ["3 1 4 1 ="] * 4 and call["completions"] == texts
        assert call["kwargs"] == {"ground_truth": ["3"] * 4}
        assert [list(c) for c in call["completion_ids"]] == [P.unpack_ints(s.token_ids).tolist() for s in group.samples]
        assert (call["trainer_state"].global_step, call["trainer_state"].max_steps) == (0, cfg.trainer.total_steps)

        assert [s.rewards[0] for s in conv_group.samples] == [0.0] * 4  # ran on messages; the tiny model writes no tags
        call = trl_rewards.CALLS[-1]
        assert call["prompts"] == [CONVERSATIONAL["prompt"]] * 4
        assert call["completions"] == [[{"role": "assistant", "content": t}] for t in conv_texts]
        assert conv_group.prompt_ids == standard.prompt_ids
    finally:
        if engine is not None:
            engine.shutdown()


def test_a_prompt_column_of_neither_format_is_refused_with_the_reason():
    from learner.prompts import Prompts
    from learner.validation import Rejected

    prompts = Prompts([{"prompt": {"text": "3 1"}}, {"prompt": [{"role": "user"}]}], "prompt", lambda p: [4], 16, 256)
    for pid in (0, 1):
        with pytest.raises(Rejected, match="expected text, or a list of {role, content} messages"):
            prompts.item(0, pid)
