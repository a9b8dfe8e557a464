"""Where an engine's start goes (issue 52 item 4, launch to the first step): the generator's vLLM engine for a config,
built in this process under cProfile. vLLM's engine core is built in-process (`EngineCore`, as `AsyncLLM`'s core
process builds it) with its one worker beside it (the `uni` executor), so the profile holds the model load,
torch.compile, the CUDA graphs and the warm-up after them. Run it twice on one machine: the first start fills the
compile caches (cold), the second finds them (warm).

    python -m bench.engine_start --config configs/gpu-smollm2-math.yaml --name warm [--top 40] [--no-profile]
        [--capture-sizes 1,2,4,...] [--set generator.compile=false]

Result: bench/results/engine_start_<config>_<name>_<machine>.json: the seconds of vLLM's imports and of the build,
and the functions of the build that took the longest, by cumulative time (those of vllm, torch, triton, flashinfer
and this project) and by own time. The profiler made the build 2.5-3x longer on an H200 (50.6-57.4 s against 13-20 s
in a run's log): `--no-profile` times it alone, e.g. against `--capture-sizes` (vLLM's 51 CUDA-graph sizes or fewer).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from bench.common import result_name, write_result

KEEP = ("vllm", "torch", "triton", "flashinfer", "generator", "pipeline", "transformers")


def build(config_path: str, capture_sizes: list[int] | None = None, overrides: list[str] | None = None):
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor import Executor

    from generator.engine import engine_config
    from pipeline.config import load_config
    from pipeline.tinymodel import resolve_model_path

    cfg = load_config(config_path, overrides or [])
    if capture_sizes:  # the CUDA graphs' batch sizes, vLLM's own list (51 sizes up to 512) unless given
        create = AsyncEngineArgs.create_engine_config

        def with_sizes(self, *args, **kwargs):
            self.compilation_config.cudagraph_capture_sizes = capture_sizes
            return create(self, *args, **kwargs)

        AsyncEngineArgs.create_engine_config = with_sizes  # type: ignore[method-assign]
    config = engine_config(cfg, resolve_model_path(cfg.model.path), cfg.generator.seed)
    config.parallel_config.distributed_executor_backend = "uni"  # the worker in this process, under the profile
    return EngineCore(config, Executor.get_class(config), log_stats=False)


def profiled(stats: pstats.Stats) -> list[dict]:
    """Every function of KEEP's packages in the profile, with its calls, own and cumulative seconds."""
    return [{"function": f"{path.split('site-packages/')[-1]}:{line} {name}", "calls": calls,
             "own_s": round(own, 3), "cumulative_s": round(cumulative, 3)}
            for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items()  # type: ignore[attr-defined]
            if any(f"/{k}/" in path for k in KEEP)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/gpu-smollm2-math.yaml")
    p.add_argument("--name", default="", help="cold, warm, ... (in the result's name)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--capture-sizes", default="", help="comma-separated CUDA graph sizes (vLLM's list if empty)")
    p.add_argument("--no-profile", action="store_true", help="time the build alone: cProfile made it 2.5-3x longer")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override, e.g. generator.compile=false")
    a = p.parse_args()
    sizes = [int(x) for x in a.capture_sizes.split(",") if x]
    start = time.perf_counter()
    import vllm.v1.engine.core  # noqa: F401  (its imports timed apart from the build, and left out of the profile)

    imported = time.perf_counter() - start
    profile = None if a.no_profile else cProfile.Profile()
    if profile is not None:
        profile.enable()
    core = build(a.config, sizes, a.overrides)
    if profile is not None:
        profile.disable()
    seconds = time.perf_counter() - start - imported
    core.shutdown()
    functions = profiled(pstats.Stats(profile)) if profile is not None else []
    flags = (f" --capture-sizes {a.capture_sizes}" if sizes else "") + (" --no-profile" if a.no_profile else "") + \
        "".join(f" --set {s}" for s in a.overrides)
    write_result(result_name("engine_start", Path(a.config).stem, a.name), f"python -m bench.engine_start --config "
                 f"{a.config} --name {a.name}{flags}", a.config, {
                     "import_s": round(imported, 2), "build_s": round(seconds, 2), "profiled": profile is not None,
                     "by_cumulative": sorted(functions, key=lambda r: -r["cumulative_s"])[:a.top],
                     "by_own": sorted(functions, key=lambda r: -r["own_s"])[:a.top]})


if __name__ == "__main__":
    main()
