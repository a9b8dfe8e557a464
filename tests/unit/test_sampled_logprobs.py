"""generator.sampled_logprobs.Tap, the host side of the log-probs kept in the vLLM worker: rows handed out per
request, written by position, taken once; room made when more requests than rows are in flight. (That the hook
records vLLM's own numbers at the right places is tested with the real engine: tests/integration/test_engine.py,
tests/gpu/test_gpu_engine.py.)"""

from __future__ import annotations

import numpy as np
import torch

from generator import sampled_logprobs
from generator.sampled_logprobs import Tap


def _step(tap: Tap, ids: list[str], positions: list[int], values: list[float], keep=None, running=None) -> None:
    tap.record(torch.tensor(values), ids, np.array(positions, dtype=np.int64), np.ones(len(ids), bool) if keep is None
               else np.array(keep), set(ids) if running is None else running)


def test_rows_by_request_and_position_taken_once():
    tap = Tap(width=8)
    _step(tap, ["a-1234abcd", "0_b-5678ef01"], [0, 0], [-0.5, -1.0])
    _step(tap, ["a-1234abcd", "0_b-5678ef01"], [0, 1], [-9.0, -2.0], keep=[False, True])  # a: a prefill chunk
    _step(tap, ["0_b-5678ef01", "a-1234abcd"], [2, 1], [-3.0, -0.25])  # rows reordered between steps
    assert tap.take(["a", "0_b"], [2, 3]) == [[-0.5, -0.25], [-1.0, -2.0, -3.0]]
    assert tap.take(["a"], [2]) == ["no sampled log-probs were recorded for request a"]  # taken already
    assert len(tap.free) == sampled_logprobs._FIRST_ROWS  # both rows back


def test_missing_positions_are_named_not_filled():
    tap = Tap(width=4)
    _step(tap, ["r1-00000000"], [0], [-1.0])
    _step(tap, ["r1-00000000"], [2], [-1.0])
    assert tap.take(["r1"], [3]) == ["request r1: log-probs missing at 1 of 3 positions (first 1)"]
    _step(tap, ["r2-00000000", "dummy-0"], [0, 0], [-1.0, -1.0], running={"r2-00000000"})  # a warm-up's row
    assert tap.take(["r2", "dummy"], [1, 1]) == [[-1.0], "no sampled log-probs were recorded for request dummy"]


def test_rows_double_when_all_are_held_and_stale_ones_are_reused(monkeypatch):
    monkeypatch.setattr(sampled_logprobs, "_FIRST_ROWS", 2)
    monkeypatch.setattr(sampled_logprobs, "_STALE_STEPS", 3)
    tap = Tap(width=4)
    _step(tap, ["x-00000000", "y-00000000", "z-00000000"], [0, 0, 0], [-1.0, -2.0, -3.0])
    assert len(tap.values) == 4  # three requests in flight: twice the rows, nothing lost
    assert tap.take(["x", "y", "z"], [1, 1, 1]) == [[-1.0], [-2.0], [-3.0]]
    # requests that left the engine untaken (aborted): their rows are reused once stale, not kept for ever
    _step(tap, [f"q{i}-00000000" for i in range(4)], [0] * 4, [-1.0] * 4)
    for _ in range(4):
        _step(tap, [], [], [], running=set())
    _step(tap, ["new-00000000"], [0], [-7.0], running={"new-00000000"})
    assert len(tap.values) == 4 and tap.take(["new", "q0"], [1, 1])[0] == [-7.0]
