"""Reward functions as TRL's documentation writes them (GRPO Trainer, "Using a custom reward function"), unchanged,
and one that records what it was called with."""

import re

CALLS: list[dict] = []


def reward_func(completions, **kwargs):
    """Reward function that gives higher scores to longer completions."""
    return [float(len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def ground_truth_reward(completions, ground_truth, **kwargs):
    # the first character of the answer against the dataset's column (TRL's example matches a \boxed{} answer)
    return [1.0 if c[:1] == gt else 0.0 for c, gt in zip(completions, ground_truth, strict=True)]


def recorded(prompts, completions, completion_ids, trainer_state, **kwargs):
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      trainer_state=trainer_state, kwargs=kwargs))
    return [0.0] * len(completions)
