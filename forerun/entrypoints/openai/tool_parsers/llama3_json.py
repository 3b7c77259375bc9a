"""`llama3_json`: a response that is nothing but calls, as JSON objects separated by `;` (Llama 3.1-3.3).

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

The `<|python_tag|>` is optional; `parameters` and `arguments` are both read. A response that does not
start with an object, or whose objects are no calls, is content.
"""

from __future__ import annotations

from forerun.entrypoints.openai.tool_parsers.base import (Malformed, ParsedTools, ToolParser, call_sequence,
                                                          content_of)

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Invariant: see ToolParser; a response is either all content or all calls."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.lstrip()
        if body.startswith(TAG):
            body = body[len(TAG):].lstrip()
        elif not final and TAG.startswith(body):
            return ParsedTools("")  # could still become the tag
        if not body.startswith("{"):
            if not body and not final:
                return ParsedTools("")
            return ParsedTools(content_of([text]))
        try:
            return ParsedTools("", call_sequence(body, 0, final, ";", None, names=self.names))
        except Malformed:
            return ParsedTools(content_of([text]))
