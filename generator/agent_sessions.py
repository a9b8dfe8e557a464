"""A sample's session of the agent endpoint (generator/endpoint.py) and what it records: the parts of its trajectory.

Exact tokens. A session keeps what its model saw and sampled as token ids. A prompt whose text begins with the text of
that context (the chat template rendering the history the model wrote, with a tool's reply after it) is that context's
token ids followed by the new text's: the sampled ids are never tokenized again. A prompt that does not (the history
re-rendered differently, or edited) is tokenized whole and starts a new part of the trajectory (a split). Each call is
recorded: its prompt's ids, the sampled ids, their behaviour log-probs and the weights versions that sampled them;
`Session.parts` turns the calls into the trajectory's samples.
"""

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from generator.rollout import seed_of
from pipeline import protocol as P


@dataclass
class Part:
    """A stretch of a trajectory whose every call extended the one before: its context, then every token after it
    (the model's, mask 1; the prompts' additions in between, a tool's reply, mask 0)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)  # (start in token_ids, version) of each call's tokens
    first_version: int = 0
    last_version: int = 0
    finish_reason: str = ""
    gen_ms: float = 0.0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Session:
    """One sample's calls. `sampling.max_tokens` bounds the tokens after each part's context; a part ends where a
    prompt does not extend it, and a session makes at most P.MAX_PARTS of them."""

    def __init__(self, key: str, engine, tokenizer, sampling: P.Sampling, max_model_len: int = 0,
                 seed: int | None = None):
        self.key, self.engine, self.tok, self.sampling = key, engine, tokenizer, sampling
        self.seed = seed  # the sample's (generator/rollout.py seed_of); each call's is made from it
        self.max_model_len = max_model_len  # 0: unchecked here (the engine's own check)
        self.parts: list[Part] = []
        self.extra: dict = {}  # what the rollout strategy keeps with the sample (an environment's instance)
        self.calls = 0
        self.open = True
        self.lock = asyncio.Lock()  # one call at a time: each extends what the one before left

    def extend(self, text: str) -> list[int]:
        """Token ids of a prompt given as text: the current part's context followed by the new text's tokens where
        the text begins with the context's, else the whole text tokenized."""
        if self.parts:
            context = self.parts[-1].context
            done = self.tok.decode(context, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if text.startswith(done):
                return context + self._ids(text[len(done):])
        return self._ids(text)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    async def complete(self, prompt_ids: list[int], max_tokens: int | None):
        """Sample one completion of `prompt_ids` and record it in the trajectory."""
        async with self.lock:
            return await self._complete(prompt_ids, max_tokens)

    async def complete_text(self, text: Callable[[], str], max_tokens: int | None,
                            inline: bool = False) -> tuple[list[int], Any]:
        """(the prompt's ids, its completion) of a prompt given as text (`text` renders it), in the lock, so the text
        extends the context as the call before left it. Rendered and tokenized off the event loop (a long text takes
        seconds), or on it where the request is small (`inline`: a thread's hand-off costs more than the work)."""
        async with self.lock:
            ids = self.extend(text()) if inline else await asyncio.to_thread(lambda: self.extend(text()))
            return ids, await self._complete(ids, max_tokens)

    async def _complete(self, prompt_ids: list[int], max_tokens: int | None):
        if self.max_model_len and len(prompt_ids) >= self.max_model_len:
            raise Refused(400, f"the prompt is {len(prompt_ids)} tokens, and the context holds "
                               f"generator.max_model_len={self.max_model_len}: no room for a completion")
        part = self._part_for(prompt_ids)
        left = self.sampling.max_tokens - (len(prompt_ids) - len(part.prompt_ids))
        if left <= 0:
            raise Refused(400, f"this sample's tokens after its prompt reached sampling.max_tokens "
                               f"({self.sampling.max_tokens}): no room for another completion")
        sampling = dataclasses.replace(self.sampling, max_tokens=min(left, max_tokens or left))
        (out,) = await self.engine.generate(prompt_ids, 1, sampling, seed=seed_of(self.seed, self.calls))
        if not self.open:
            raise Refused(410, "the session ended while the call ran")
        if not self.parts or part is not self.parts[-1]:  # a new part, kept once its call is (a refused one is not)
            self.parts.append(part)
        added = prompt_ids[len(part.context):]  # what the prompt put after the context: the environment's tokens
        part.token_ids += added
        part.logprobs += [0.0] * len(added)
        part.mask += [0] * len(added)
        part.first_version = min(part.first_version, out.first_version) if part.turns else out.first_version
        part.last_version = max(part.last_version, out.last_version)
        part.turns.append((len(part.token_ids), out.first_version))
        part.token_ids += out.token_ids
        part.logprobs += out.logprobs
        part.mask += [1] * len(out.token_ids)
        part.finish_reason, part.gen_ms = out.finish_reason, part.gen_ms + out.gen_ms
        self.calls += 1
        return out

    def _part_for(self, prompt_ids: list[int]) -> Part:
        """The part this prompt extends, else a new one (not yet in `parts`)."""
        if self.parts:
            context = self.parts[-1].context
            if prompt_ids[:len(context)] == context:
                return self.parts[-1]
        if len(self.parts) >= P.MAX_PARTS:
            raise Refused(400, f"this sample's history was re-rendered {len(self.parts)} times (a new part each, at "
                               f"most {P.MAX_PARTS}); send the history as the model wrote it")
        return Part(list(prompt_ids))
