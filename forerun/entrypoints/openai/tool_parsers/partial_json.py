"""Reading JSON that is still being generated: where each value starts and (once it has) ends.

The tool parsers need the raw text of a call's `arguments` object while the model is still writing
it, so that streamed pieces concatenate to exactly the string the whole response carries. This scanner
never decodes values; it only finds their spans. `json.loads` on a finished span is the real check.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_LITERAL = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")
_CLOSE = {"{": "}", "[": "]"}


class Incomplete(Exception):
    """The text ends inside the value: more may come."""


class Malformed(ValueError):
    """The text cannot be the start of the expected JSON, whatever follows."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def value_end(text: str, i: int) -> int:
    """The index just past the JSON value starting at `text[i]` (nesting and strings are followed,
    commas and colons are not checked: a finished span still goes through `json.loads`)."""
    if i >= len(text):
        raise Incomplete
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in _CLOSE:
        return _container_end(text, i)
    m = _LITERAL.match(text, i)
    if m is None:
        rest = text[i:]
        if any(word.startswith(rest) for word in ("true", "false", "null", "-")):
            raise Incomplete
        raise Malformed(f"unexpected {c!r} at {i}")
    if m.end() == len(text):
        raise Incomplete  # a number may go on
    return m.end()


def _string_end(text: str, i: int) -> int:
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    raise Incomplete


def _container_end(text: str, i: int) -> int:
    stack = [_CLOSE[text[i]]]
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == '"':
            j = _string_end(text, j)
            continue
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in "}]":
            if c != stack.pop():
                raise Malformed(f"unbalanced {c!r} at {j}")
            if not stack:
                return j + 1
        j += 1
    raise Incomplete


@dataclass(frozen=True)
class Span:
    """A member's value: `text[start:end]`, or `text[start:]` so far when `end` is None."""

    start: int
    end: int | None


@dataclass(frozen=True)
class ObjectScan:
    """The members of one object read so far; `end` is set once its closing brace was read."""

    members: dict[str, Span]
    end: int | None


def scan_object(text: str, i: int) -> ObjectScan:
    """Members of the object whose `{` is at `text[i]`; raises Malformed on text no JSON object has."""
    if i >= len(text) or text[i] != "{":
        raise Malformed(f"expected '{{' at {i}")
    members: dict[str, Span] = {}
    i = skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        return ObjectScan(members, i + 1)
    while i < len(text):
        if text[i] != '"':
            raise Malformed(f"expected a key at {i}")
        try:
            key_end = _string_end(text, i)
        except Incomplete:
            break
        key = _decode_key(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            raise Malformed(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        try:
            end = value_end(text, i)
        except Incomplete:
            members[key] = Span(i, None)
            break
        members[key] = Span(i, end)
        i = skip_ws(text, end)
        if i >= len(text):
            break
        if text[i] == "}":
            return ObjectScan(members, i + 1)
        if text[i] != ",":
            raise Malformed(f"expected ',' or '}}' at {i}")
        i = skip_ws(text, i + 1)
    return ObjectScan(members, None)


def _decode_key(raw: str) -> str:
    try:
        return json.loads(raw)
    except ValueError:
        raise Malformed(f"bad key {raw!r}") from None
