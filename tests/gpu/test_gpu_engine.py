"""GPU, one vLLM engine with CUDA graphs and vLLM's defaults (asynchronous scheduling where it has it): the
sampled tokens' log-probs the worker keeps (generator/sampled_logprobs.py) are vLLM's own, position for
position, through chunked prefills and preemptions."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.config import load_config
from pipeline.environment import apply_environment
from pipeline.tinymodel import resolve_model_path
from tests.gpu.helpers import gpu_count
from tests.integration.test_engine import check_sampled_logprobs_in_the_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
    pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU"),
]


def test_sampled_logprobs_kept_in_the_worker_are_vllms_on_a_gpu(model_cache, monkeypatch) -> None:
    # the engine starts in pytest's process, where the GPU modules' collection has asked torch for the GPUs: vLLM,
    # seeing CUDA not initialized, forked its engine core, which failed with "Cannot re-initialize CUDA in forked
    # subprocess" (an H100, vLLM 0.26). A generator's process touches no GPU before its engine starts.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    apply_environment(load_config(None, ["generator.enforce_eager=false"]), "0")
    check_sampled_logprobs_in_the_worker(resolve_model_path("builtin:tiny"), dtype="bfloat16", enforce_eager=False,
                                         gpu_memory_utilization=0.3)
