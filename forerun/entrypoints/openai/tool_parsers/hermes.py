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
                                                          content_of, held_back, object_call)
from forerun.entrypoints.openai.tool_parsers.partial_json import skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """Invariant: see ToolParser; `content` never holds a whole call."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        parts: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                parts.append(text[pos:] if final else held_back(text[pos:], (START,)))
                break
            parts.append(text[pos:start])
            body_at = start + len(START)
            end = text.find(END, body_at)
            closed = end >= 0
            body = text[body_at:end] if closed else text[body_at:]
            if not (closed or final):
                body = held_back(body, (END,))
            try:
                call = block_call(body, final or closed, self.names)
            except Malformed:
                # No call, now or later: the block is text (when open, all of it so far is).
                parts.append(text[start:end + len(END)] if closed else text[start:])
                if not closed:
                    break
                pos = end + len(END)
                continue
            if call is not None:
                calls.append(call)
            if not closed:
                break
            pos = end + len(END)
        return ParsedTools(content_of(parts), calls)


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
