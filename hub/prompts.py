"""The dataset side of a lease: a prompt (text, or TRL's conversational list of messages), its other columns (for
the reward functions), and its token ids as the hub tokenises them; generators generate from these ids and a
rollout must echo them. A prompt no engine can take (neither text nor messages, empty after tokenising, too long
for generator.max_model_len, ids outside the model's vocabulary) is refused here, with the reason, before any
generator is asked."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hub.validation import Rejected, check_prompt_ids
from pipeline import protocol as P
from pipeline.tasks import is_conversational


class Prompts:
    def __init__(self, rows: list[dict], column: str, encode: Callable[[str | list], list[int]], vocab_size: int,
                 max_model_len: int) -> None:
        self.rows, self.column, self.encode = rows, column, encode  # encode: prompt text -> token ids
        self.vocab_size, self.max_model_len = vocab_size, max_model_len

    def __len__(self) -> int:
        return len(self.rows)

    def item(self, epoch: int, prompt_id: int) -> P.PromptItem:
        """Raises Rejected naming what is wrong with the prompt."""
        row = self.rows[prompt_id]
        prompt = row[self.column]
        if not isinstance(prompt, str) and not is_conversational(prompt):
            raise Rejected("prompt", f"data.prompt_column {self.column!r} holds {type(prompt).__name__} "
                                     f"{str(prompt)[:80]!r}: expected text, or a list of {{role, content}} messages")
        ids = np.asarray(self.encode(prompt), dtype=np.int32)
        check_prompt_ids(ids, self.vocab_size)
        if not len(ids):
            raise Rejected("prompt", "empty after tokenising")
        if len(ids) >= self.max_model_len:
            raise Rejected("prompt", f"{len(ids)} tokens leave no room for a completion within "
                                     f"generator.max_model_len={self.max_model_len}")
        columns = {k: v for k, v in row.items() if k != self.column}
        if isinstance(prompt, str):
            return P.PromptItem(prompt_id, epoch, prompt, columns, P.pack_ints(ids))
        return P.PromptItem(prompt_id, epoch, "", columns, P.pack_ints(ids), messages=prompt)
