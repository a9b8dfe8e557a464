"""The tool calls in a model's turn, read by vLLM's tool-call parser (generator.tool_parser), for the agent
endpoint (generator/endpoint.py) and the environment strategy (generator/environment.py)."""

import logging
from typing import Any


class ToolCalls:
    """The tool calls in a model's turn, read by vLLM's tool-call parser of that name (generator.tool_parser: vLLM's
    --tool-call-parser names); a name vLLM does not have is refused when the strategy is made, at the start. `lazy`
    (an agent worker's, whose generator checked the name): vLLM's parsers are imported at the first turn read, as
    importing them imports vLLM (2.8 s on 2 cores, more on a fresh GPU host, in each of the workers started at once)."""

    def __init__(self, name: str, lazy: bool = False):
        self.name = name
        self._parser: Any = None
        if not lazy:
            self.parser()  # the check at the start

    def parser(self):
        """vLLM's parser class of this name (imported at the first call)."""
        if self._parser is None:
            from vllm.tool_parsers import ToolParserManager

            try:
                self._parser = ToolParserManager.get_tool_parser(self.name)
            except KeyError:
                raise ValueError(f"generator.tool_parser: vLLM has no tool parser {self.name!r}; it has "
                                 f"{', '.join(sorted(ToolParserManager.list_registered()))}") from None
        return self._parser

    def read(self, tok, text: str, tools: list[dict]) -> tuple[str | None, list]:
        """(the text besides the calls, the calls: vLLM's ToolCall, OpenAI's shape); no calls: (text, [])."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        # a call the model wrote wrong is no call, not an error of the run; vLLM's parsers log each with its traceback
        # (set here: vLLM's logging setup, when its engine starts, resets it)
        parser = self.parser()
        logging.getLogger(parser.__module__).setLevel(logging.CRITICAL)
        request = ChatCompletionRequest.model_validate({"model": "policy", "messages": [], "tools": tools or None})
        found = parser(tok).extract_tool_calls(text, request)
        return (found.content, list(found.tool_calls)) if found.tools_called else (text, [])


def turn_text(tok, ids: list[int]) -> str:
    """A turn's text as a tool parser reads it: special tokens kept (some templates' tool-call tags are), the
    end-of-turn token that ended it left out."""
    if ids and ids[-1] in tok.all_special_ids:
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=False)
