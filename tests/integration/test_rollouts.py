"""The rollout interface with the real CPU engine: the calculator example (generator/calculator.py) puts a tool's
reply into the context of a second turn; the reply is in the sample's tokens with mask 0 and log-prob 0, the
model's own tokens with mask 1, and the sample is valid for the hub and trains on the mask in the learner."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.config import apply_environment, config_from_dict
from pipeline.tinymodel import resolve_model_path
from tests.integration.helpers import Sink

pytestmark = pytest.mark.integration


def test_a_tools_reply_is_in_the_context_and_out_of_the_loss(model_cache):
    from transformers import AutoTokenizer

    from generator.calculator import answer
    from generator.engine import Engine
    from generator.service import Generator
    from learner.batching import build_rows, collate
    from learner.validation import Expected, RunShape, check_rollout

    cfg = config_from_dict({"generator": {"rollout": "generator.calculator:rollout", "max_num_seqs": 32},
                            "sampling": {"max_tokens": 12}, "trainer": {"group_size": 8}})
    apply_environment(cfg)
    path = resolve_model_path("builtin:tiny")
    tok = AutoTokenizer.from_pretrained(path)
    eq = tok.convert_tokens_to_ids("=")
    prompts = ["3 + 4 =", "1 2 - 5 =", "7 =", "9 + 9 ="]

    async def scenario():
        engine = Engine(cfg, path, seed=0, eos_id=tok.eos_token_id)
        try:
            gen = Generator(cfg, engine, tok, "tcp://127.0.0.1:1")
            gen.welcome, gen.push = SimpleNamespace(group_size=8), Sink()
            items = [P.PromptItem(i, 0, p, {"target": "1"}, P.pack_ints(tok(p, add_special_tokens=False)["input_ids"]))
                     for i, p in enumerate(prompts)]
            lease = P.Lease(1, 0, items, P.Sampling(12, 1.0))
            await asyncio.gather(*(gen._group(lease, it) for it in items))
            return gen.push.sent, items
        finally:
            engine.shutdown()

    groups, items = asyncio.run(scenario())
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
