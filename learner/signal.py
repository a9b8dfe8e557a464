"""Whether the steps still teach anything. A sample's advantage is its reward against its group's (GRPO), so a group
whose samples share one reward adds nothing to the gradient (`groups/zero_variance` in a step's record). When at
least SHARE of the groups of the last EVERY steps did, rank 0 says so in its log, with the reward and the completion
length, and what gives a signal again: a task beyond the policy (every reward 0) or below it, or a policy that
collapsed onto one answer. On reasoning-gym's letter_counting, SmolLM2-135M-Instruct answered one fixed count to
every question from step 60 on: completions of 8 tokens, 31-32 of 32 groups equal, held-out pass@4 equal to pass@1
(docs/figures.md, "A second task"). Nothing here changes what is trained."""

from __future__ import annotations

EVERY = 10  # steps a warning looks at
SHARE = 0.9  # of their groups with one reward for all their samples


class Signal:
    """Rank 0's records as they come (`add`): a warning every EVERY steps while the signal is gone."""

    def __init__(self, every: int = EVERY):
        self.every = every
        self.window: list[dict] = []

    def add(self, record: dict) -> str | None:
        self.window.append(record)
        if len(self.window) < self.every:
            return None
        window, self.window = self.window, []
        groups = sum(len(r.get("trained", ())) for r in window)
        equal = sum(r.get("groups/zero_variance", 0) for r in window)
        if not groups or equal < SHARE * groups:
            return None
        reward = sum(r.get("reward/mean", 0.0) for r in window) / len(window)
        tokens = sum(r.get("tokens/completion_mean", 0.0) for r in window) / len(window)
        return (f"no learning signal in steps {window[0]['step']}-{window[-1]['step']}: {equal} of {groups} groups had "
                f"one reward for all their samples (reward {reward:.3f}, completions {tokens:.1f} tokens on average), "
                "so their advantages were zero: the policy answers each prompt the same way every time, or the task is "
                "beyond it or below it. A higher sampling.temperature, a larger trainer.group_size, a lower trainer.lr "
                "or a graded reward gives it a signal again")
