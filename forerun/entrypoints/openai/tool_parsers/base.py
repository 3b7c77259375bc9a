"""What every tool parser returns, and the pieces several of them share.

One `parse(text, final)` serves both the whole response and the stream: the stream parses the text
so far with `final=False` and sends what changed, so the streamed pieces add up to the whole response
by construction instead of by a second, separately written streaming parser.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forerun.entrypoints.openai.tool_parsers.partial_json import Incomplete, Malformed, scan_object, skip_ws


@dataclass(frozen=True)
class ParsedCall:
    """One call. `name` is None while it is still being written; `arguments` is JSON text of an object
    (while streaming, a prefix of the final text)."""

    name: str | None
    arguments: str


@dataclass(frozen=True)
class ParsedTools:
    """A response split into the text outside calls and the calls, in order."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolSpec:
    """What a parser may need to know of one offered tool (its name and parameter schema)."""

    name: str
    parameters: dict[str, Any]


class ToolParser(ABC):
    """Splits model output into content and tool calls.

    Invariant (what makes streaming agree with the whole response): for well-formed output `t` and any
    prefix `p` of it, `parse(p, final=False)` is a prefix state of `parse(t, final=True)`: its content is
    a prefix of the final content, its calls are the first calls of the final ones, each with the same
    name or None, and arguments that are a prefix of the final arguments. Text that is no valid call is
    returned as content, never raised.
    """

    def __init__(self, tools: list[ToolSpec]) -> None:
        self.tools = {t.name: t for t in tools}
        self.names = frozenset(self.tools)

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedTools:
        """The content and calls of `text`; with `final=False`, only what later text cannot change."""


def held_back(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a last piece that may be the start of one of `markers` (decided by what follows)."""
    for k in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return text[:-k]
    return text


def content_of(parts: list[str]) -> str:
    """Text outside calls, without surrounding whitespace (what stays between and around the calls of a
    response is layout). Stripping keeps the stream monotone: the strip of a prefix is a prefix of the
    strip of the whole."""
    return "".join(parts).strip()


def tagged_calls(text: str, final: bool, start_tag: str, end_tag: str,
                 call_of: Callable[[str, bool], ParsedCall | None]) -> ParsedTools:
    """The calls of a format that writes each one between `start_tag` and `end_tag` (hermes, qwen3_xml);
    `call_of(body, whole)` reads one block's text (`whole`: it is complete) and raises Malformed for a
    block that is no call. A block left open at the end counts when its text is a whole call; a block
    that is no call is content, markers included; a marker's possible start is held back mid-stream."""
    parts: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(start_tag, pos)
        if start < 0:
            parts.append(text[pos:] if final else held_back(text[pos:], (start_tag,)))
            break
        parts.append(text[pos:start])
        body_at = start + len(start_tag)
        end = text.find(end_tag, body_at)
        closed = end >= 0
        body = text[body_at:end] if closed else text[body_at:]
        if not (closed or final):
            body = held_back(body, (end_tag,))
        try:
            call = call_of(body, final or closed)
        except Malformed:
            # No call, now or later: the block is text (when open, all of it so far is).
            parts.append(text[start:end + len(end_tag)] if closed else text[start:])
            if not closed:
                break
            pos = end + len(end_tag)
            continue
        if call is not None:
            calls.append(call)
        if not closed:
            break
        pos = end + len(end_tag)
    return ParsedTools(content_of(parts), calls)


def check_name(name: str, names: frozenset[str] | None) -> str:
    """`name`, when it is one of the offered `names` (None: any); a call of a tool nobody offered is
    text the model wrote, not a call a client can run."""
    if names is not None and name not in names:
        raise Malformed(f"no tool named {name!r} was offered")
    return name


def object_call(text: str, i: int, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters"),
                names: frozenset[str] | None = None) -> tuple[ParsedCall | None, int | None]:
    """The call written as a JSON object `{"name": ..., "arguments": {...}}` starting at `text[i]`, and
    the index past it (None while it is open). Raises Malformed for what no call can become (with
    `final`: also for a call left open, a name that is no string, arguments that are no object)."""
    scan = scan_object(text, i)
    name: str | None = None
    span = scan.members.get("name")
    if span is not None and span.end is not None:
        name = json.loads(text[span.start:span.end]) if _is_json(text[span.start:span.end]) else None
        if not isinstance(name, str) or not name:
            raise Malformed("the name is no string")
        check_name(name, names)
    args_span = next((scan.members[k] for k in args_keys if k in scan.members), None)
    if final:
        if scan.end is None or name is None:
            raise Malformed("the call is not complete")
        if args_span is None:
            return ParsedCall(name, "{}"), scan.end
        raw = text[args_span.start:args_span.end]
        if not _is_json(raw) or not isinstance(json.loads(raw), dict):
            raise Malformed("the arguments are no JSON object")
        return ParsedCall(name, raw), scan.end
    if args_span is None or text[args_span.start] != "{":
        args = ""  # arguments that are no object cannot be streamed: they end up as text
    else:
        args = text[args_span.start:args_span.end if args_span.end is not None else len(text)]
    return ParsedCall(name, args), scan.end


def call_sequence(text: str, i: int, final: bool, separator: str, closing: str | None,
                  args_keys: tuple[str, ...] = ("arguments", "parameters"), names: frozenset[str] | None = None
                  ) -> list[ParsedCall]:
    """Calls written as JSON objects one after another from `text[i]`, each after `separator`, up to
    `closing` (or the end of the text when None). Raises Malformed as `object_call` does; with `final`,
    also when anything but whitespace follows."""
    calls: list[ParsedCall] = []
    i = skip_ws(text, i)
    if closing is not None and i < len(text) and text[i] == closing and not calls:
        return _after(text, i + 1, final, calls)
    while i < len(text):
        call, end = object_call(text, i, final, args_keys, names)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls
        i = skip_ws(text, end)
        if i >= len(text):
            break
        if closing is not None and text[i] == closing:
            return _after(text, i + 1, final, calls)
        if text[i] != separator:
            raise Malformed(f"expected {separator!r} at {i}")
        i = skip_ws(text, i + 1)
    if final and (closing is not None or not calls):
        raise Malformed("the calls are not complete")
    return calls


def _after(text: str, i: int, final: bool, calls: list[ParsedCall]) -> list[ParsedCall]:
    if final and text[i:].strip():
        raise Malformed("text after the calls")
    return calls


def _is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


__all__ = ["Incomplete", "Malformed", "ParsedCall", "ParsedTools", "ToolParser", "ToolSpec", "call_sequence",
           "check_name", "content_of", "held_back", "object_call", "tagged_calls"]
