"""`mistral`: calls after the `[TOOL_CALLS]` marker, as a JSON array or, in newer models, by name.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}

Text before the first marker is content. What follows a marker and is no call is content.
"""

from __future__ import annotations

import json
import re

from forerun.entrypoints.openai.tool_parsers.base import (Malformed, ParsedCall, ParsedTools, ToolParser,
                                                          call_sequence, check_name, content_of, held_back)
from forerun.entrypoints.openai.tool_parsers.partial_json import Incomplete, skip_ws, value_end

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_\-.]+")


class MistralToolParser(ToolParser):
    """Invariant: see ToolParser."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        start = text.find(MARKER)
        if start < 0:
            return ParsedTools(content_of([text if final else held_back(text, (MARKER,))]))
        head = text[:start]
        rest = text[start + len(MARKER):]
        try:
            if rest.lstrip().startswith("["):
                calls = call_sequence(rest, skip_ws(rest, 0) + 1, final, ",", "]", names=self.names)
            else:
                calls = _named_calls(rest, final, self.names)
        except Malformed:
            return ParsedTools(content_of([text]))
        return ParsedTools(content_of([head]), calls)


def _named_calls(text: str, final: bool, names: frozenset[str]) -> list[ParsedCall]:
    """`name[ARGS]{...}` repeated, each after its own marker (the first marker is already read)."""
    calls: list[ParsedCall] = []
    i = 0
    while True:
        m = _NAME.match(text, i)
        if m is None and (final or text[i:]):
            raise Malformed("expected a function name")
        if m is None or m.end() == len(text):  # the name may go on
            if final:
                raise Malformed("the call is not complete")
            return calls
        j = m.end()
        if not text.startswith(ARGS, j):
            if not final and ARGS.startswith(text[j:]):
                return calls
            raise Malformed("expected [ARGS]")
        name = check_name(m.group(0), names)
        j = skip_ws(text, j + len(ARGS))
        if j >= len(text):
            if final:
                raise Malformed("missing arguments")
            return calls + [ParsedCall(name, "")]
        if text[j] != "{":
            raise Malformed("the arguments are no JSON object")
        try:
            end = value_end(text, j)
        except Incomplete:
            if final:
                raise Malformed("the arguments are not complete") from None
            return calls + [ParsedCall(name, text[j:])]
        raw = text[j:end]
        try:
            if not isinstance(json.loads(raw), dict):
                raise Malformed("the arguments are no JSON object")
        except ValueError:
            raise Malformed("the arguments are no JSON") from None
        calls.append(ParsedCall(name, raw))
        i = skip_ws(text, end)
        if i == len(text):
            return calls
        if text.startswith(MARKER, i):
            i += len(MARKER)
            continue
        if not final and MARKER.startswith(text[i:]):
            return calls
        raise Malformed("text after the calls")
