"""Shared pieces of the benchmarks: a random-weight model of a real shape, a synthetic dataset, a reward
with variance, result files, and `Services`, which starts a learner and generators as processes.

Models are built locally (no download): Qwen2.5's shape with random weights and a word-level tokenizer
of the same vocabulary size ("t0" .. "t151935"), so decoding and reward scoring cost what they would
on real text of the same token count. Processes are stopped by process group, never by name.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from pipeline import protocol as P
from pipeline.client import request_once
from pipeline.launcher import Child

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("BENCH_RESULTS", ROOT / "bench" / "results"))  # run_gpu.sh: $OUT/results
PGIDS = Path(os.environ.get("BENCH_PGIDS", "/tmp/bench-pgids.txt"))
QWEN_SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


def build_model(size: str, dest: Path, seed: int = 0) -> Path:
    """A random-weight Qwen2 of `size` ("0.5b", "1.5b", "7b"; "tiny", "smollm2": the builtin ones) in bf16, with
    tokenizer."""
    dest = Path(dest)
    if size == "tiny":
        from pipeline.tinymodel import build_tiny_model

        return build_tiny_model(dest)
    if size == "smollm2":  # a real pretrained model that runs on CPU (135M parameters; pipeline/smollm2.py)
        from pipeline.tinymodel import resolve_model_path

        return Path(resolve_model_path("builtin:smollm2"))
    if (dest / "config.json").exists():
        return dest
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    cfg = qwen_shaped_config(size)
    # single characters first (letters, digits, byte-level space "Ġ"): prompts of letters encode to ids whether
    # transformers honours tokenizer.json or rebuilds a byte-level BPE from the vocabulary (no merges)
    chars = ["<unk>", *"abcdefghijklmnopqrstuvwxyz0123456789", "Ġ"]
    vocab = {QWEN_SPECIAL.get(i, chars[i] if i < len(chars) else f"t{i}"): i for i in range(cfg.vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> {% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|> {% endif %}")
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _pin_tokenizer_class(tmp)
    os.replace(tmp, dest)
    return dest


def qwen_shaped_config(size: str):
    """A Qwen2Config of a Qwen2.5 model's shape ("0.5b", "1.5b", "7b"), for random weights."""
    from transformers import Qwen2Config

    shapes = {
        "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, tie_word_embeddings=True),
        "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, tie_word_embeddings=True),
        "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, tie_word_embeddings=False),
    }
    return Qwen2Config(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                       bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", **shapes[size])


MODELS, RUNS = Path("/tmp/bench-models"), Path("/tmp/bench-runs")


def add_model_args(p, run: str | None = None) -> None:
    """--model-size, --model-dir (default: the size's own directory under /tmp/bench-models) and, given a
    run name, --run-dir (default /tmp/bench-runs/RUN): the arguments every benchmark takes."""
    p.add_argument("--model-size", default="0.5b")
    p.add_argument("--model-dir", default=None, help="default: /tmp/bench-models/q-SIZE")
    if run:
        p.add_argument("--run-dir", type=Path, default=RUNS / run)


def model_from_args(args) -> Path:
    return build_model(args.model_size, Path(args.model_dir or MODELS / f"q-{args.model_size}"))


def _pin_tokenizer_class(path: Path) -> None:
    """Make AutoTokenizer load tokenizer.json as is (some transformers 5 releases map model_type qwen2 to
    Qwen2Tokenizer, whose BPE has no merges for this vocabulary and encodes our prompts to nothing)."""
    from transformers import AutoTokenizer

    cfg_path = path / "tokenizer_config.json"
    base = json.loads(cfg_path.read_text())
    best = base
    for cls in ("PreTrainedTokenizerFast", "TokenizersBackend", None):
        cfg = dict(base)
        if cls:
            cfg["tokenizer_class"] = cls
        else:
            cfg.pop("tokenizer_class", None)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        try:
            ids = AutoTokenizer.from_pretrained(path)("a b c", add_special_tokens=False)["input_ids"]
        except Exception as e:  # try the next class
            print(f"tokenizer class {cls}: {e}", flush=True)
            continue
        print(f"tokenizer class {cls}: {ids}", flush=True)
        if list(ids) == [1, 2, 3]:
            return
        if ids:
            best = cfg
    cfg_path.write_text(json.dumps(best, indent=2))  # not word-level, but prompts still encode to ids


def write_dataset(path: Path, rows: int = 4096, prompt_tokens: int = 32, vocab: int = 151000, seed: int = 0) -> Path:
    """JSONL with `prompt` (random word-level tokens) and `answer` columns."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(prompt_tokens))
            f.write(json.dumps({"prompt": prompt, "answer": str(rng.randrange(100))}) + "\n")
    return path


def standalone_hub(cfg, run_dir: Path, run_id: str, model: str):
    """A hub without a learner (generator benchmarks): it tokenises prompts with the model's tokenizer and announces
    the model's own weights as version 0, which generators load before they generate (a run's weights)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from hub.hub import Hub
    from pipeline.tasks import encode_prompt, load_rows
    from weights import senders
    from weights.files import write_shm
    from weights.plan import checksum, serialize

    tok = AutoTokenizer.from_pretrained(model)
    hub = Hub(cfg, load_rows(cfg.data), run_dir, run_id, encode=lambda text: encode_prompt(tok, cfg.data, text),
              vocab_size=AutoConfig.from_pretrained(model).vocab_size)
    hub.serve_weights(senders(cfg, hub, run_id))  # as the learner does
    tensors = {k: v for f in sorted(Path(model).glob("*.safetensors")) for k, v in load_file(f).items()}
    blob = serialize(tensors.items())
    hub.announce(P.WeightsReady(0, file=P.FileVersion(len(blob), checksum(blob), write_shm(run_id, 0, blob))), blob)
    return hub


def parity_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """Fraction of odd token ids: random-weight models get rewards with variance, so no group is skipped."""
    return [sum(t & 1 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def machine() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return {"gpus": out, "gpu_count": len(out), "cpus": os.cpu_count(), "host": os.uname().nodename}


def machine_key(gpus: bool = True) -> str:
    """The machine in a result's name: GPU model and count ("h200x4"), or CPU cores ("cpu2") without GPUs."""
    names = [g.split(",")[0].removeprefix("NVIDIA ") for g in machine()["gpus"]] if gpus else []
    if not names:
        return f"cpu{os.cpu_count()}"
    model = re.split(r"[\s-]", names[0].strip())[0].lower()  # "H100 80GB HBM3" -> "h100"
    return f"{model}x{len(names)}"


def result_name(benchmark: str, *settings: str, gpus: bool = True) -> str:
    """A result's file name: the benchmark, what it ran with (model shape, setting), and the machine,
    e.g. weight_sync_nccl_0.5b_h200x2. `gpus`: False for benchmarks that run on the CPU alone."""
    parts = [re.sub(r"[^\w.]+", "-", s) for s in settings if s]
    return "_".join([benchmark, *parts, machine_key(gpus)])


def write_result(name: str, command: str, model: str, metrics: dict | list, quiet: bool = False, **extra) -> Path:
    """bench/results/NAME.json (or $BENCH_RESULTS/NAME.json): the command, model, machine, date and figures; printed
    too unless `quiet` (a result rewritten as a pass goes on). Written whole or not at all."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "command": command, "model": model, "metrics": metrics, **extra}
    path = RESULTS / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    if not quiet:
        print(json.dumps(record, indent=2), flush=True)
    return path


def run_config(model: str, data: str, **sections) -> dict:
    """A run config for benchmarks: bf16, fixed-length completions, the parity reward; `sections` override."""
    cfg = {
        "model": {"path": model, "dtype": "bfloat16"},
        "data": {"path": data},
        "rewards": [{"fn": "bench.common:parity_reward"}],
        "sampling": {"max_tokens": 64, "ignore_eos": True, "temperature": 1.0},
        "trainer": {"total_steps": 10, "batch_size": 8, "group_size": 4, "max_staleness": 1, "lr": 1e-6,
                    "loss": "decoupled", "zero_stage": 0, "micro_batch_tokens": 16384},
        "generator": {"gpu_memory_utilization": 0.45, "max_model_len": 512, "enforce_eager": True, "lease_size": 8},
        "hub": {"heartbeat_timeout_s": 60.0},
        "weights": {"transport": "auto"},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    if "tiny" in Path(model).name:  # CPU smoke runs: 256 positions, a vocabulary for the embedded task only
        cfg["generator"]["max_model_len"] = 256
        cfg["model"]["dtype"] = "float32"
        cfg["data"] = {"path": "builtin:echo"}
        cfg.pop("rewards")
    return cfg


class Services:
    """A learner and generators as separate `pipeline` processes, each in its own process group."""

    def __init__(self, run_dir: Path, cfg: dict, use_gpus: bool = True, prefix: dict[str, list[str]] | None = None):
        """`prefix`: what runs the "learner" or the "generator" (`ip netns exec NS`: another host, bench/netns.py)."""
        self.prefix = prefix or {}
        self.run_dir = Path(run_dir)
        if self.run_dir.exists():  # a fresh run: an old hub.json or metrics.jsonl would be read as this run's
            shutil.rmtree(self.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.cfg_path = self.run_dir / "bench.yaml"
        self.cfg_path.write_text(yaml.safe_dump(cfg))
        self.use_gpus = use_gpus
        self.children: list[Child] = []
        self.started: dict[str, float] = {}
        self.address = ""
        signal.signal(signal.SIGTERM, _exit_on_term)  # `timeout` stops the driver: still stop the children

    def _argv(self, *args: str, gpus: str, overrides: tuple[str, ...] = ()) -> list[str]:
        argv = [*self.prefix.get(args[0], []), sys.executable, "-m", "pipeline", *args, "-c", str(self.cfg_path)]
        for o in overrides:
            argv += ["--set", o]
        if self.use_gpus:
            argv += ["--gpus", gpus]
        return argv

    def start_learner(self, gpus: str = "0", timeout: float = 300) -> str:
        argv = self._argv("learner", gpus=gpus) + ["--run-dir", str(self.run_dir)]
        self.started["learner"] = time.time()
        learner = start_child("learner", argv, self.run_dir / "logs" / "learner.log")
        self.children.append(learner)
        deadline = time.monotonic() + timeout  # seconds; DeepSpeed's first start may build an op
        while time.monotonic() < deadline:
            if (self.run_dir / "hub.json").exists():
                self.address = json.loads((self.run_dir / "hub.json").read_text())["address"]
                return self.address
            if learner.proc.poll() is not None:
                raise RuntimeError(f"learner exited with {learner.proc.returncode}:\n{learner.tail(40)}")
            time.sleep(0.1)
        raise RuntimeError(f"no hub within {timeout} s:\n{learner.tail(40)}")

    def start_generator(self, name: str = "generator-0", gpus: str = "1", overrides: tuple[str, ...] = ()) -> Child:
        argv = self._argv("generator", gpus=gpus, overrides=overrides) + ["--learner", self.address]
        self.started[name] = time.time()
        child = start_child(name, argv, self.run_dir / "logs" / f"{name}.log")
        self.children.append(child)
        return child

    @property
    def learner(self) -> Child:
        return self.children[0]

    def metrics(self) -> list[dict]:
        from pipeline.metrics import read_metrics

        return read_metrics(self.run_dir)

    def events(self, name: str | None = None) -> list[dict]:
        from pipeline.metrics import read_jsonl

        return [e for e in read_jsonl(self.run_dir / "events.jsonl") if name is None or e["event"] == name]

    def status(self) -> dict:
        reply = request_once(self.address, P.StatusRequest())
        return P.as_dict(reply) if isinstance(reply, P.StatusReply) else {}

    def set(self, key: str, value) -> None:
        reply = request_once(self.address, P.SetRequest(key, value))
        if isinstance(reply, P.Error):
            raise RuntimeError(f"set {key}={value}: {reply.message}")

    def wait_steps(self, n: int, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = self.metrics()
            if len(records) >= n:
                return records
            self.check_alive()
            time.sleep(0.1)
        raise RuntimeError(f"{len(self.metrics())} of {n} steps after {timeout} s\n{self.tails()}")

    def wait_registered(self, n: int, timeout: float) -> None:
        """Until `n` generators have registered (their engines are up)."""
        deadline = time.monotonic() + timeout
        while len(self.events("register")) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.events('register'))} of {n} generators registered after {timeout} s\n"
                                   f"{self.tails()}")
            self.check_alive()
            time.sleep(0.2)

    def check_alive(self) -> None:
        for c in self.children:
            if c.proc.poll() is not None and c.proc.returncode != 0:
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{c.tail(40)}")

    def tails(self, n: int = 25) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.tail(n)}" for c in self.children)

    def stop(self) -> None:
        for c in reversed(self.children):
            c.stop(grace=10)

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def generate_bare(llm, prompt_ids: list[list[int]], params, tag: str) -> int:
    """Every prompt through a vLLM AsyncLLM's own `generate` at once, with `params` (a SamplingParams); the
    completion tokens generated."""
    import asyncio

    async def one(i: int, ids: list[int]) -> int:
        final = None
        async for out in llm.generate({"prompt_token_ids": ids}, params, request_id=f"{tag}-{i}"):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    return sum(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompt_ids))))


def start_child(name: str, argv: list[str], log_path: Path, env: dict | None = None) -> Child:
    """A benchmark's child process (own session, repository on PYTHONPATH, `env` added), tracked for run_gpu.sh."""
    child = Child(name, argv, log_path, env=_env() | (env or {}))
    with PGIDS.open("a") as f:  # run_gpu.sh stops leftovers by these ids (children run in new sessions)
        f.write(f"{child.pid}\n")
    return child


def _exit_on_term(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def memory_peak(stop: threading.Event, peak: list[int], index: int = 0) -> None:
    """peak[0]: the most memory in use on GPU `index` (NVML, every process on it) until `stop` is set."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        while not stop.is_set():
            peak[0] = max(peak[0], pynvml.nvmlDeviceGetMemoryInfo(h).used)
            time.sleep(0.2)
    except Exception:  # no NVML (CPU smoke run)
        return


def log_times(path: Path, pattern: str) -> list[tuple[float, str]]:
    """(unix time, line) of log lines containing `pattern` (the logging format starts with asctime)."""
    import datetime

    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if pattern in line:
            try:
                stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            out.append((stamp, line))
    return out


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2
