"""Reading the output of a forced call (`tool_choice` "required" or a named function).

A forced call is generated under a JSON-schema grammar (see `forerun.entrypoints.openai.tool_request`),
not in the model's own call format, so it is read here rather than by the `--tool-call-parser`:

- named: the output is the arguments object itself;
- required: the output is a JSON array `[{"name": ..., "parameters": {...}}, ...]`.

The grammar makes the text well-formed; only a response cut by `max_tokens` ends early, and then its
calls are returned as far as they got (as they were streamed).
"""

from __future__ import annotations

from forerun.entrypoints.openai.tool_parsers.base import Malformed, ParsedCall, ParsedTools, ToolParser, call_sequence
from forerun.entrypoints.openai.tool_parsers.partial_json import skip_ws


class NamedCallParser(ToolParser):
    """Invariant: exactly one call, named `name`, whose arguments are the whole output."""

    def __init__(self, name: str) -> None:
        super().__init__([])
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedTools:
        return ParsedTools("", [ParsedCall(self.name, text)])


class RequiredCallsParser(ToolParser):
    """Invariant: the calls of a (possibly cut) JSON array of `{"name", "parameters"}` objects."""

    def __init__(self) -> None:
        super().__init__([])

    def parse(self, text: str, final: bool) -> ParsedTools:
        i = skip_ws(text, 0)
        if i == len(text):
            return ParsedTools("")
        try:
            if text[i] != "[":
                raise Malformed("expected '['")
            calls = call_sequence(text, i + 1, False, ",", "]", args_keys=("parameters",))
        except Malformed:
            return ParsedTools(text.strip())  # cannot happen under the grammar; never a crash
        if final:
            calls = [c for c in calls if c.name is not None]
        return ParsedTools("", calls)
