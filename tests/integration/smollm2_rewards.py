"""A reward for the real-model test: math_answer, less 0.001 per completion token so that every group has a reward
spread and every step trains (a group of equal rewards is skipped, and so is its mismatch check). It records what
it was given (one JSON line per call, in the file that SMOLLM2_REWARDS names) so the test can check that reward
functions receive the decoded assistant messages."""

import json
import os

from pipeline.tasks import math_answer


def recorded_math(prompts, completions, completion_ids, answer, **kwargs):
    with open(os.environ["SMOLLM2_REWARDS"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions,
                            "completion_ids": [list(c) for c in completion_ids]}) + "\n")
    right = math_answer(prompts, completions, completion_ids, answer=answer)
    return [r - 0.001 * len(ids) for r, ids in zip(right, completion_ids, strict=True)]
