"""Model loading, the DeepSpeed engine with its finite-step guard, and full-weight gathering (ZeRO-3 aware)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.config import Config, TrainerConfig

if TYPE_CHECKING:
    from learner.adapters import AdaptersOff

log = logging.getLogger(__name__)


def init_distributed(timeout_s: float = TrainerConfig.rank_timeout_s) -> tuple[int, int]:
    """Join the learner's process group (gloo on CPU, nccl on GPU), whose collectives fail after `timeout_s`
    (trainer.rank_timeout_s) rather than wait for a rank that is gone. A lone learner is rank 0 of 1."""
    from datetime import timedelta

    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    # a dead generator's nccl group must fail its broadcast (we drop that peer), not end the learner
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from pipeline.netutil import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    if torch.cuda.is_available():  # torchrun shows every GPU of the node: a rank takes its LOCAL_RANK's
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(auto_mpi_discovery=False, timeout=timedelta(seconds=timeout_s))
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def control_group(world: int, timeout_s: float = TrainerConfig.rank_timeout_s) -> Any:
    """The ranks' group for rank 0's messages (learner/service.py `_from_rank0`: each batch, the news of the groups
    buffered, "still waiting" every KEEPALIVE_S): gloo, on the CPU, whatever the ranks train with. A rank that waits
    for rank 0 waits in a socket read. Over nccl it waited in a kernel that spins on its GPU until rank 0 sends (for
    as long as rank 0 waits for rollouts), and an engine beside it on that GPU (one engine per learner GPU,
    configs/colocated-2gpu.yaml) had the GPU in turns with that kernel. NCCL's maintainers advise the same for a
    kernel that would spin: meet on the CPU first (NVIDIA/nccl#1025). None with one rank. Every rank calls it once,
    right after init_distributed: making a group is a collective."""
    if world == 1:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def leave_distributed() -> None:
    """A rank that finished ends its process group itself, before the interpreter does: left to the interpreter's
    exit, gloo's threads once aborted a finished rank ("terminate called without an active exception", SIGABRT, in a
    run of tests/integration/test_torchrun.py), and torchrun's agent on the other node then waited 300 s at its
    exit barrier for the failed one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Extras:
    """What the learner keeps beside DeepSpeed's engine (nothing is added to the engine itself)."""

    guard: FiniteGuard  # the finite-step guard, on the optimizer the engine steps
    reference: torch.nn.Module | AdaptersOff | None = None  # trainer.kl_coef > 0: the KL penalty's frozen model
    bytes_per_token: float = 0.0  # learner/step.py's MemoryWatch: the most a micro-batch took so far


def build_engine(cfg: Config, model_path: str) -> tuple[Any, Extras]:
    """(DeepSpeed's engine, the learner's Extras beside it)."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    t = cfg.trainer
    if torch.cuda.is_available():  # refused before the weights load: a card too small fails minutes later otherwise
        import torch.distributed as dist

        from pipeline.memory import check_learner

        ranks = dist.get_world_size() if dist.is_initialized() else 1
        total = cap_gpu_memory(t.gpu_memory_gb)
        log.info("memory: %s", check_learner(cfg, model_path, total, ranks))  # the cap as the card, where set
    torch.manual_seed(t.seed)
    dtype = run_dtype(cfg)
    if cfg.model.quantization is not None:  # QLoRA: the frozen base quantized (pipeline/quantization.py)
        model = load_quantized(cfg, model_path, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    quiet_dropout(model)  # before the adapters: model.lora.dropout is theirs
    if cfg.model.lora is not None:  # PEFT adapters on the frozen base (learner/adapters.py)
        from learner.adapters import wrap

        model = wrap(model, cfg.model.lora, dtype)
    # from_pretrained leaves a model in eval mode, where transformers' layers skip gradient checkpointing: the knob
    # was accepted and did nothing until 2026-11-29 (docs/figures.md). PEFT's new modules trained already.
    model.train()
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if cfg.model.lora is not None:
            inputs_require_grad(model)  # else no gradient reaches the adapters through frozen embeddings
    if t.compile:
        compile_layers(model)
    model.config.use_cache = False
    lean = t.zero_stage == 0  # the optimizer step is ours (MixedAdamW), not DeepSpeed's fp16 wrapper's
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0 if lean else t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage} | ({"offload_optimizer": {
            "device": "cpu", "pin_memory": torch.cuda.is_available()}} if t.offload_optimizer else {}),
        "bf16": {"enabled": dtype == torch.bfloat16 and not lean},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False}},  # it synchronised the device at every micro-batch
        "zero_allow_untested_optimizer": True,  # GuardedAdamW is torch's AdamW with a switch to skip a step
    }
    # A torch optimizer instead of DeepSpeed's: no FusedAdam JIT build (slow, and broken on arch 9.0a).
    fused = torch.cuda.is_available()
    optimizer: GuardedAdamW
    if lean:
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0)))
        optimizer = MixedAdamW(model, dtype, device, t.grad_clip, lr=t.lr, weight_decay=t.weight_decay, fused=fused)
    elif t.offload_optimizer:  # DeepSpeed steps offloaded partitions with its CPU Adam only
        optimizer = guarded_cpu_adam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    else:
        optimizer = GuardedAdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, fused=fused)
    guard = FiniteGuard(model, optimizer, per_micro_batch=not lean)  # hooks before DeepSpeed wraps them
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    extras = Extras(guard)
    if t.kl_coef > 0 and cfg.model.lora is not None:  # the base itself, adapters off: no second copy
        from learner.adapters import AdaptersOff

        extras.reference = AdaptersOff(engine.module)
    elif t.kl_coef > 0:  # the frozen initial model of the KL penalty: a whole copy on each rank, in the run's dtype
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(engine.device).eval()
        ref.config.use_cache = False
        extras.reference = ref.requires_grad_(False)
    return engine, extras


def cap_gpu_memory(gb: float) -> int:
    """Cap torch's allocator in this process at `gb` GB of this rank's GPU (trainer.gpu_memory_gb; 0: no cap) and
    return the GPU's bytes. Past the cap an allocation fails with CUDA's out-of-memory error, as on a card of that
    size; the CUDA context and NCCL's buffers, outside the allocator, come on top. Set before anything is allocated:
    the cap counts what the allocator holds."""
    device = torch.cuda.current_device()  # the rank's, chosen in init_distributed
    total = torch.cuda.mem_get_info(device)[1]
    if gb > 0:
        torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 1e9 / total), device)
        log.info("trainer.gpu_memory_gb: this rank's allocator capped at %.1f GB of the GPU's %.1f GB", gb,
                 total / 1e9)
    return total


def free_gpu_bytes(device=None) -> int:
    """What this process may still allocate on its GPU: the device's free memory plus what torch's allocator holds
    unused, within the allocator's cap (trainer.gpu_memory_gb) where one is set."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    room = free + torch.cuda.memory_reserved(device) - allocated
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # (a torch without it: the card)
    return int(min(room, (fraction(device) if fraction else 1.0) * total - allocated))


def run_dtype(cfg: Config) -> torch.dtype:
    """The dtype the learner holds its weights in (model.dtype)."""
    return torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32


def load_quantized(cfg: Config, model_path: str, dtype: torch.dtype):
    """The model with its linear layers quantized by bitsandbytes, on this rank's device (where bitsandbytes
    quantizes them, as the generators on that kind of device do). Its quantized weights must be those the generators
    compute the base of (pipeline.quantization.quantized_names)."""
    from transformers import AutoModelForCausalLM

    from pipeline.quantization import bnb_config, exact_on_cpu, quantized_modules, quantized_names

    q = cfg.model.quantization
    assert q is not None  # called for model.quantization only
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, quantization_config=bnb_config(q, dtype),
                                                 device_map={"": device})
    mine, theirs = quantized_modules(model), quantized_names(model_path, q)
    if sorted(mine) != sorted(theirs):
        raise RuntimeError(f"model.quantization: the learner quantized {len(mine)} weights, the generators would "
                           f"serve {len(theirs)} as quantized ({sorted(set(mine) ^ set(theirs))[:3]})")
    exact_on_cpu(model)
    log.info("model.quantization %s: %d linear weights quantized by bitsandbytes", q, len(mine))
    for name in mine:  # a checkpoint holds no part of the frozen base, its quantization statistics neither
        model.get_submodule(name.removesuffix(".weight")).register_state_dict_post_hook(_left_out)
    return model


def _left_out(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]


def quiet_dropout(model) -> None:
    """The base model trains without dropout, as it did in eval mode: its log-probs of a sample are then the
    engine's, which has none (TRL's disable_dropout). Dropout layers are set to 0, and so are the rates that
    transformers' modules keep as numbers (attention_dropout, a layer's dropout, layerdrop). The config, which the
    final model is saved with, keeps its values."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and name.endswith(("dropout", "_pdrop", "layerdrop")):
                setattr(module, name, 0.0)


def input_embeddings(model):
    """The model's input embeddings, or None for a model without them (a test's plain module)."""
    return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None


def inputs_require_grad(model) -> None:
    """Make the frozen embeddings' output require a gradient, where gradients are on, so one reaches the adapters
    through the first layer under gradient checkpointing, and every compiled layer sees the same input. PEFT's
    enable_input_require_grads does it under torch.no_grad too: there the first layer's input then required a
    gradient and the others' did not, and the compiled layers made two graphs for the no-gradient passes (SmolLM2's
    QLoRA learner on an H200, 2026-11-30: three graphs in its first step of 99.7 s, where two are needed)."""
    def hook(module, args, output):
        if torch.is_grad_enabled():
            output.requires_grad_(True)

    if getattr(model, "_inputs_require_grad", None) is None:  # once, whether checkpointing or compile asks first
        model._inputs_require_grad = model.get_input_embeddings().register_forward_hook(hook)


def compile_layers(model) -> int:
    """torch.compile each decoder layer in place (the classes the model names in `_no_split_modules`), with dynamic
    shapes: one graph for every layer and micro-batch size. In place, so parameter names stay as they are; lazy, so
    the cast to bf16 comes first. The lm_head stays eager; on a GPU the log-prob passes are Triton kernels
    of their own (learner/kernels.py). Returns the number of layers compiled.

    Each guard the graph carries that a run can cross compiles every layer again, so three are taken away:
    - inductor's mix-order reductions are off: whether to fuse them depends on the micro-batch's rows x length (at
      least 5 Mi elements), a guard that compiled every layer again when a micro-batch crossed it mid-run;
    - with frozen embeddings (LoRA, QLoRA) the first layer's input needs no gradient and the others' do, a guard
      that gave the first layer a graph of its own: the embeddings' output is made to require one where gradients
      are on (`inputs_require_grad`; the first layer then computes its input's gradient, which nothing uses);
    - duck shapes are off: a micro-batch whose length equals the head dimension or the hidden size (64 or 576 for
      SmolLM2, 128 for Qwen) was traced with its length tied to that constant, so the first graph was specialised
      to it and the next length compiled everything again.
    Cold, on CPU, SmolLM2's QLoRA learner compiled 4 graphs in its first two micro-batches (73 s) before, 1 (34 s)
    after (docs/figures.md, "One graph for a LoRA learner"). The log-prob passes without gradients (proximal,
    reference) make one graph more: dynamo guards on the grad mode too."""
    import torch.fx.experimental._config as fx_config
    from torch._inductor import config as inductor

    options = {"triton.mix_order_reduction": False} if hasattr(inductor.triton, "mix_order_reduction") else None
    fx_config.use_duck_shape = False  # a process setting: the learner compiles nothing else
    embeddings = input_embeddings(model)
    if embeddings is not None and not any(p.requires_grad for p in embeddings.parameters()):
        inputs_require_grad(model)
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise ValueError(f"trainer.compile: {type(model).__name__} names no decoder layers (_no_split_modules) to "
                         "compile")
    for layer in layers:
        layer.compile(dynamic=True, options=options)
    return len(layers)


class GuardedAdamW(torch.optim.AdamW):
    """AdamW whose step can be switched off: DeepSpeed's engine.step() still runs its bookkeeping (reductions,
    zeroing, copying the unchanged master weights back), but neither weights nor optimizer state change."""

    skip = False
    grad_norm: torch.Tensor | None  # set by a FiniteGuard that measures the gradients at the step's end

    def step(self, closure=None):
        if self.skip:
            return None
        return super().step(closure)


def guarded_cpu_adam(params, **kwargs) -> GuardedAdamW:
    """DeepSpeed's CPU Adam (AdamW mode: decoupled weight decay, as torch's AdamW) with GuardedAdamW's switch: the
    optimizer of trainer.offload_optimizer. DeepSpeed's engine refuses a torch optimizer for offloaded states."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    class GuardedCPUAdam(DeepSpeedCPUAdam):
        skip = False
        grad_norm: torch.Tensor | None = None

        def step(self, closure=None, *args, **kwargs):
            if self.skip:
                return None
            return super().step(closure, *args, **kwargs)

    return GuardedCPUAdam(params, adamw_mode=True, **kwargs)  # type: ignore[return-value]


class MixedAdamW(GuardedAdamW):
    """Without ZeRO, the whole optimizer step, in a few multi-tensor kernels and no host sync. (DeepSpeed's fp16
    wrapper, which ran it for bf16 before, read every parameter's gradient back to the host to look for an overflow
    and made five kernels per parameter more: 290 syncs a step for the 0.5B shape.)

    The model's parameters are cast to `dtype` and moved to `device` (buffers keep their dtype, as DeepSpeed's cast
    did: RoPE's inverse frequencies stay fp32); the optimizer steps fp32 master copies of the loaded weights (the
    parameters themselves when `dtype` is fp32), from the model's gradients cast to fp32 and clipped to a norm of
    `clip` by the finite guard's norm (`grad_norm`, a device tensor the guard measures first), then copies them back
    into the model. A checkpoint (`state_dict`) carries the masters; one that DeepSpeed's wrapper wrote loads too."""

    def __init__(self, model, dtype: torch.dtype, device, clip: float, **kwargs):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = []
        self.pairs = []  # (fp32 master, the model's parameter) where the two differ: not when `dtype` is fp32
        for p in self.params:  # one at a time: the fp32 model never lies on the device whole beside its masters
            master = p if dtype == torch.float32 else p.detach().to(device, torch.float32, copy=True).requires_grad_()
            p.data = p.data.to(device, dtype)
            self.masters.append(master)
            if master is not p:
                self.pairs.append((master, p))
        self.clip = clip
        self.grad_norm: torch.Tensor | None = None  # of the gradients of the next step
        super().__init__(self.masters, **kwargs)

    def step(self, closure=None):
        if self.skip:
            return None
        mixed = [(m, p) for m, p in self.pairs if p.grad is not None]
        for m, p in mixed:
            m.grad = p.grad.float()
        grads = [m.grad for m in self.masters if m.grad is not None]
        if self.clip > 0 and grads:
            norm = total_norm(grads) if self.grad_norm is None else self.grad_norm
            torch._foreach_mul_(grads, (self.clip / (norm.float() + 1e-6)).clamp(max=1.0))
        super().step(closure)
        self.grad_norm = None
        if mixed:
            torch._foreach_copy_([p.data for _, p in mixed], [m for m, _ in mixed])
            for m, _ in mixed:
                m.grad = None
        return None

    def state_dict(self):
        state = super().state_dict()
        state["masters"] = [m for m, _ in self.pairs]
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        saved = state.pop("masters", [])
        if "fp32_groups" in state:  # a checkpoint of DeepSpeed's FP16_UnfusedOptimizer, which ran this step before
            saved = [m for group in state["fp32_groups"] for m in group]
            state = state["optimizer_state_dict"]
        mine = [m for m, _ in self.pairs]
        if len(saved) != len(mine):
            raise ValueError(f"the checkpoint holds {len(saved)} fp32 master weights, this model {len(mine)}")
        with torch.no_grad():
            for m, s in zip(mine, saved, strict=True):
                m.copy_(s)
        super().load_state_dict(state)


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `tensors` together, in fp32, as a device tensor: one multi-tensor pass, no host sync."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)))


class FiniteGuard:
    """The last line of defence against poisoned weights: a step whose loss or gradient is not finite (NaN,
    inf, or a norm past float32) on any rank is skipped. `step_is_finite` agrees across ranks (one all-reduce of
    one number).

    Under ZeRO 1-3 DeepSpeed moves each gradient away (reduced, partitioned) as it is computed, so a hook measures
    every parameter's gradient of every micro-batch first. Without ZeRO the gradients of the step's micro-batches
    are summed in `p.grad` until the optimizer's step, and a value that is not finite stays so in a sum, so they are
    measured once, at the step's end, in one multi-tensor norm (`per_micro_batch=False`): a kernel per parameter
    and micro-batch fewer, where the step of a small model is bound by launching kernels. That norm is the step's
    gradient norm too (`grad_norm`)."""

    def __init__(self, model, optimizer: GuardedAdamW, per_micro_batch: bool = True):
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.per_micro_batch = per_micro_batch
        self.grad_norm: torch.Tensor | None = None  # per_micro_batch=False: of the last step checked
        self._norms: list[torch.Tensor] = []  # this step's gradient norms and losses, one device value each
        if per_micro_batch:
            for p in self.params:
                p.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        # one kernel per parameter and micro-batch; the norms are checked once, in step_is_finite. A norm past
        # float32 is inf.
        self._norms.append(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32))

    def add_loss(self, loss: torch.Tensor) -> None:
        self._norms.append(loss.detach().float())

    def step_is_finite(self, device) -> bool:
        """Whether every loss and gradient of this step, on every rank, was finite; resets for the next step."""
        import torch.distributed as dist

        if not self.per_micro_batch:
            grads = [p.grad.detach() for p in self.params if p.grad is not None]
            self.grad_norm = total_norm(grads) if grads else torch.zeros((), device=device)
            self._norms.append(self.grad_norm)
            self.optimizer.grad_norm = self.grad_norm  # MixedAdamW clips by it
        values = torch.stack([n.to(device) for n in self._norms]) if self._norms else torch.zeros(1, device=device)
        bad = (~torch.isfinite(values)).any().float().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self._norms = []
        return not bool(bad.item())


GATHER_BYTES = 256 * 2**20  # ZeRO-3: parameters gathered together, up to this many bytes (or one larger one)


def gathered_weights(engine, zero_stage: int, named: list | None = None,
                     group_bytes: int = GATHER_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full parameter on the learner's device) in order, of `named` (default: every parameter of the
    engine's module). Under ZeRO-3 consecutive parameters are
    gathered together (one coalesced all-gather) up to `group_bytes`, for the time the consumer holds them,
    then released: the extra device memory stays under max(group_bytes, the largest parameter), which for
    1.5B and larger shapes is the embedding alone. The tensors are the live parameters: copy what must
    outlive the next optimizer step."""
    named = engine.module.named_parameters() if named is None else named
    if zero_stage != 3:
        yield from ((name, p.data.detach()) for name, p in named)
        return
    import deepspeed

    for group in _groups(named, group_bytes):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
            yield from ((name, p.data.detach()) for name, p in group)


def _groups(named, limit: int) -> Iterator[list]:
    """Consecutive (name, ZeRO-3 parameter) pairs, in lists of at most `limit` full bytes (or one pair)."""
    group: list = []
    size = 0
    for name, p in named:
        n = p.ds_numel * p.element_size()
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append((name, p))
        size += n
    if group:
        yield group


def save_hf(engine, cfg: Config, tokenizer, out_dir, rank: int) -> None:
    """Final weights in Hugging Face format (loadable with from_pretrained). Every rank takes part in the gathers
    (collective under ZeRO-3); only rank 0, which writes, holds the CPU copy (a whole model in host memory: 14 GB
    for a 7B model in bf16: once, not once per rank)."""
    state = {}
    for name, t in gathered_weights(engine, cfg.trainer.zero_stage):
        if rank == 0:
            state[name] = t.to("cpu", copy=True)
    if rank == 0:
        engine.module.save_pretrained(out_dir, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
