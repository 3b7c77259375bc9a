"""`hermes`: calls as JSON objects between `<tool_call>` and `</tool_call>` (Hermes, Qwen2.5, Qwen3).

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block left open at the end (the model stopped before `</tool_call>`) still counts when its JSON is a
whole call. A block whose text is no call is returned as content, markers included.
"""

from __future__ import annotations

from forerun.entrypoints.openai.tool_parsers.base import (Malformed, ParsedCall, ParsedTools, ToolParser,
                                                          object_call, tagged_calls)
from forerun.entrypoints.openai.tool_parsers.partial_json import skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """Invariant: see ToolParser; `content` never holds a whole call."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        return tagged_calls(text, final, START, END, lambda body, whole: block_call(body, whole, self.names))


def block_call(body: str, whole: bool, names: frozenset[str]) -> ParsedCall | None:
    """The call in one block's text; with `whole`, the text must be exactly one complete call."""
    i = skip_ws(body, 0)
    if i == len(body):
        if whole:
            raise Malformed("empty block")
        return None
    call, end = object_call(body, i, whole, names=names)
    if end is not None and body[end:].strip():
        raise Malformed("text after the call")
    return call
