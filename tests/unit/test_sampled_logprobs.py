"""generator.sampled_logprobs.Tap, the host side of the log-probs kept in the vLLM worker: rows handed out per
request, written by position, taken once; room made when more requests than rows are in flight; and the order of
the hook's work on vLLM 0.26's GPU runner, with a stand-in for it. (That the hook records vLLM's own numbers at the
right places is tested with the real engine: tests/integration/test_engine.py, tests/gpu/test_gpu_engine.py.)"""

from __future__ import annotations

from types import SimpleNamespace

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


class _Batch:
    """What vLLM 0.26's second model runner's input batch holds for the hook (vllm/v1/worker/gpu/input_batch.py)."""

    def __init__(self, ids, seq_lens, prefill_lens, slots):
        self.req_ids, self.num_reqs, self.num_draft_tokens = ids, len(ids), 0
        self.seq_lens_cpu_upper_bound = torch.tensor(seq_lens)
        self.prefill_len_np, self.idx_mapping_np = np.array(prefill_lens), np.array(slots)


class _Sampler:
    """vLLM 0.26's Sampler (vllm/v1/worker/gpu/sample/sampler.py), its order of work."""

    def __init__(self, log: list):
        self.log = log

    def __call__(self, logits, batch):
        asked = self.returns_logprobs(batch.idx_mapping_np)
        sampled, processed = self.sample(logits, None, batch.idx_mapping_np, None, None, None, return_logprobs=asked)
        tensors = None
        if asked:  # compute_topk_scores, on the processed logits
            self.log.append("log-probs")
            tensors = SimpleNamespace(logprobs=torch.log_softmax(processed, -1).gather(-1, sampled.view(-1, 1)))
        return SimpleNamespace(sampled_token_ids=sampled.view(-1, 1), logprobs_tensors=tensors)

    def returns_logprobs(self, idx_mapping_np) -> bool:
        return False  # no request asks vLLM for log-probs

    def sample(self, logits, *args, return_logprobs=False):
        processed = logits / 0.5  # the temperature
        self.log.append(("sample", return_logprobs))
        return processed.argmax(-1), processed


class _RunnerV2:
    """The call order of vLLM 0.26's `GPUModelRunner.sample_tokens`: sample, then queue the sampled tokens' copy to
    the host (AsyncOutput, on a stream that waits for everything queued before it), then return."""

    def __init__(self, batch, logits):
        self.log: list = []
        self.sampler, self.batch, self.logits = _Sampler(self.log), batch, logits
        self.req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([5, 3])),
                                          req_id_to_index={r: i for i, r in enumerate(batch.req_ids)})

    def sample(self, hidden_states, input_batch, grammar_output):
        out = self.sampler(self.logits, input_batch)
        return out, None, None

    def sample_tokens(self, grammar_output):
        out, _, _ = self.sample(None, self.batch, grammar_output)
        self.log.append("tokens' copy queued")
        return out.sampled_token_ids.view(-1)


def test_the_log_probs_are_computed_after_the_steps_tokens_are_on_their_way(monkeypatch):
    """On vLLM 0.26's GPU runner the sampled column is computed once `sample_tokens` has queued the tokens' copy to the
    host: computed inside the sampler (vLLM's place for them), every step's copy waited for the log-prob kernels.
    From the processed logits the sampler returns when asked for log-probs, at each row's request and position."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    # a and b decode their first tokens (position 0); c is a chunk of a prefill (2 of its 4 tokens): no sample
    batch = _Batch(["a-00000000", "b-00000000", "c-00000000"], seq_lens=[5, 3, 2], prefill_lens=[5, 3, 4],
                   slots=[0, 1, 1])
    runner = _RunnerV2(batch, logits)
    hook = sampled_logprobs._RunnerV2(runner, Tap(width=8))

    def token_logprobs(processed, token_ids):  # vLLM's kernel, in torch
        runner.log.append("log-probs")
        return torch.log_softmax(processed.float(), -1).gather(-1, token_ids)

    monkeypatch.setattr(hook, "token_logprobs", token_logprobs, raising=False)
    hook.install()
    assert runner.sample_tokens(None).tolist() == [2, 0, 0]  # the sampler's own tokens, handed on
    assert runner.log == [("sample", True), "tokens' copy queued", "log-probs"]
    expected = torch.log_softmax(logits / 0.5, -1)
    assert hook.tap.take(["a", "b", "c"], [1, 1, 1]) == [
        [float(expected[0, 2])], [float(expected[1, 0])], "no sampled log-probs were recorded for request c"]
    hook.remove()
    runner.log.clear()
    runner.sample_tokens(None)
    assert runner.log == [("sample", False), "tokens' copy queued"]  # vLLM's own methods again
