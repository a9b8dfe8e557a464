"""The generator's rollout path with the real CPU engine, one engine for the module (its start is most of the time).

The rollout interface: the calculator example (generator/calculator.py) puts a tool's reply into the context of a
second turn; the reply is in the sample's tokens with mask 0 and log-prob 0, the model's own tokens with mask 1, and
the sample is valid for the hub and trains on the mask in the learner.

TRL's dataset formats: standard (text prompts) and conversational (message lists, the chat template applied,
completions handed to reward functions as assistant messages). Reward functions copied from TRL's documentation run
unchanged, with the keyword arguments TRL passes.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.config import config_from_dict, load_config
from pipeline.environment import apply_environment
from pipeline.tinymodel import VOCAB, resolve_model_path
from tests.integration import trl_rewards
from tests.integration.helpers import Sink

pytestmark = pytest.mark.integration
MOD = "tests.integration.trl_rewards"
STANDARD = {"prompt": "3 1 4 1 =", "ground_truth": "3"}
CONVERSATIONAL = {"prompt": [{"role": "user", "content": "3 1 4 1"}], "ground_truth": "3"}


@pytest.fixture(scope="module")
def engine_loop(model_cache):
    """The engine and the one event loop its tests run in (an AsyncLLM keeps to the loop it first ran in): each test
    runs its scenario with `runner.run`. Room for 32 sequences: the calculator's 4 groups of 8 at once."""
    from transformers import AutoTokenizer

    from generator.engine import Engine

    cfg = config_from_dict({"generator": {"max_num_seqs": 32}})
    apply_environment(cfg)
    path = resolve_model_path("builtin:tiny")
    runner = asyncio.Runner()
    llm = Engine(cfg, path, seed=0, eos_id=AutoTokenizer.from_pretrained(path).eos_token_id)
    try:
        yield llm, runner
    finally:
        runner.close()  # its tasks cancelled (the engine's output handler), as asyncio.run ends
        llm.shutdown()


def test_a_tools_reply_is_in_the_context_and_out_of_the_loss(engine_loop):
    from transformers import AutoTokenizer

    from generator.calculator import answer
    from generator.engines import Fixed
    from generator.service import Generator
    from generator.session import Session
    from hub.validation import Expected, RunShape, check_rollout
    from learner.batching import build_rows, collate
    from weights.base import Receiver

    engine, runner = engine_loop
    cfg = config_from_dict({"generator": {"rollout": "builtin:calculator", "max_num_seqs": 32},
                            "sampling": {"max_tokens": 12}, "trainer": {"group_size": 8}})
    path = resolve_model_path("builtin:tiny")
    tok = AutoTokenizer.from_pretrained(path)
    eq = tok.convert_tokens_to_ids("=")
    prompts = ["3 + 4 =", "1 2 - 5 =", "7 =", "9 + 9 ="]

    async def scenario():
        gen = Generator(cfg, Fixed(engine, tok), "tcp://127.0.0.1:1")
        session = Session(None, SimpleNamespace(group_size=8, session=""), Receiver(), Sink(), engine)
        items = [P.PromptItem(i, 0, p, {"target": "1"}, P.pack_ints(tok(p, add_special_tokens=False)["input_ids"]))
                 for i, p in enumerate(prompts)]
        lease = P.Lease(1, 0, items, P.Sampling(12, 1.0))
        await asyncio.gather(*(gen.group(session, lease, it) for it in items))
        return session.push.sent, items

    groups, items = runner.run(scenario())
    assert len(groups) == len(prompts)
    calls = 0
    for group, item in zip(sorted(groups, key=lambda g: g.prompt_id), items, strict=True):
        shape = RunShape(len(tok), 8, 12, cfg.generator.max_model_len, 1)
        check_rollout(group, Expected(item.prompt_ids, 1.0, 0), 0, shape)  # valid for the hub as it is
        for s in group.samples:
            ids, lps = P.unpack_ints(s.token_ids), P.unpack_floats(s.logprobs)
            mask = P.unpack_mask(s.mask, len(ids))
            assert len(ids) <= 12
            if mask.all():
                continue
            calls += 1
            start = int(np.argmin(mask))  # the tool's reply follows the model's "="
            end = start + int((mask[start:] == 0).argmin() or len(mask) - start)
            assert ids[start - 1] == eq and mask[start:end].sum() == 0 and mask[end:].all() and mask[:start].all()
            assert (lps[start:end] == 0).all() and (lps[mask == 1] < 0).all()
            reply = tok(answer(tok.decode(ids[:start - 1].tolist())), add_special_tokens=False)["input_ids"]
            assert ids[start:end].tolist() == reply
    assert calls > 0  # the random tiny model writes "=" early in about half its first turns
    rows, _ = build_rows(groups, step=0, scale_rewards=False)
    batch = collate(rows, pad_id=0, device="cpu")
    trained = sum(int(P.unpack_mask(s.mask, len(s.token_ids) // 4).sum()) for g in groups for s in g.samples
                  if np.std([x.reward for x in g.samples]) > 0)
    assert int(batch["mask"].sum()) == trained  # the learner's loss covers exactly the model's tokens


class Hub:
    def __init__(self):
        self.reports = []

    async def request(self, msg, timeout=None):
        self.reports.append(msg)
        return P.Ack()


def test_reward_functions_from_trls_documentation_run_unchanged_on_both_formats(engine_loop):
    from transformers import AutoTokenizer

    from generator.engines import Fixed
    from generator.service import Generator
    from generator.session import Session
    from hub.prompts import Prompts
    from pipeline.tasks import encode_prompt
    from weights.base import Receiver

    engine, runner = engine_loop
    cfg = load_config(None, ["sampling.max_tokens=6"])
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
        gen = Generator(gen_cfg, Fixed(engine, tok), "tcp://127.0.0.1:1")
        session = Session(Hub(), SimpleNamespace(group_size=4, session=""), Receiver(), Sink(), engine)
        await gen.group(session, P.Lease(1, 0, [it], P.Sampling(6, 1.0)), it)
        assert session.client.reports == [], session.client.reports  # no reward function failed
        (group,) = session.push.sent
        texts = [tok.decode(P.unpack_ints(s.token_ids).tolist(), skip_special_tokens=True) for s in group.samples]
        return group, texts

    async def both():
        return (await rollout([f"{MOD}:reward_func", f"{MOD}:ground_truth_reward", f"{MOD}:recorded"], standard),
                trl_rewards.CALLS[-1],
                await rollout([f"{MOD}:format_reward_func", f"{MOD}:recorded"], conversational))

    (group, texts), call, (conv_group, conv_texts) = runner.run(both())
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


def test_a_prompt_column_of_neither_format_is_refused_with_the_reason():
    from hub.prompts import Prompts
    from hub.validation import Rejected

    prompts = Prompts([{"prompt": {"text": "3 1"}}, {"prompt": [{"role": "user"}]}], "prompt", lambda p: [4], 16, 256)
    for pid in (0, 1):
        with pytest.raises(Rejected, match="expected text, or a list of {role, content} messages"):
            prompts.item(0, pid)
