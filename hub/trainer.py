"""The learner's view of rank 0's hub: what the training loop (learner/service.py) may call on it, and the figures it
reads for each step's record (`HubStats`). hub/hub.py's Hub is one; a test's fake hub needs only these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline import protocol as P


@dataclass(frozen=True)
class HubStats:
    """What the hub holds for a step's record, copied at one moment (`TrainerHub.step_stats`)."""

    tokens: int  # tokens of the rollouts received so far (the counter `tokens`)
    generators: int  # registered now
    counters: dict[str, int]  # every counter (metrics.jsonl's hub/...)
    busy: dict[str, float]  # seconds the hub's thread spent by message since it started
    stages: dict[str, dict[str, float]]  # each registered generator's seconds per stage, as its last heartbeat said
    on_learner_gpus: int = 0  # registered generators that share a GPU with a learner rank


class TrainerHub(Protocol):
    """Called on rank 0's learner thread, while the hub's own thread serves the generators."""

    def take_batch(self, step: int, wait_s: float | None = None) -> tuple[list[P.RolloutGroup] | None, dict, dict]:
        """(batch_size groups fresh enough for `step`, None when `wait_s` passed first; their stats; the knobs)."""

    def ahead(self, step: int) -> list[P.RolloutGroup]:
        """The buffered groups the batch for `step` would take first as they stand (read only: nothing moves)."""

    def finish_step(self, version: int) -> None:
        """The step that made `version` is done: its groups are trained."""

    def abandon_step(self) -> None:
        """The step was skipped: its prompts are leased again."""

    def finish_run(self) -> None:
        """Training is over: generators hear RunComplete."""

    def snapshot(self) -> dict:
        """The hub's state for a checkpoint."""

    def evaluations(self, wait_s: float = 0.0) -> list[dict]:
        """Evaluation rounds done since the last call."""

    def set_verdict(self, line: str) -> None:
        """What holds the run back, for `pipeline status`."""

    def wait_generators_gone(self, timeout: float) -> bool:
        """True once no generator is registered; False when `timeout` passed first."""

    def step_stats(self) -> HubStats:
        """The figures of a step's record, copied now."""
