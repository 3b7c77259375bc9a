"""`pythonic`: a response that is a Python list of calls (Llama 3.2 and 4, and models tuned like them).

    [get_weather(city="Paris", days=3), now()]

Keyword arguments only, with literal values (strings, numbers, booleans, None, lists, dicts). A call's
arguments are sent whole once its closing parenthesis is read; its name as soon as its `(` is.
A response that is not such a list is content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from forerun.entrypoints.openai.tool_parsers.base import (Malformed, ParsedCall, ParsedTools, ToolParser, check_name,
                                                          content_of)

_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")


class PythonicToolParser(ToolParser):
    """Invariant: see ToolParser; a response is either all content or all calls."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.strip()
        if not body.startswith("["):
            if not body and not final:
                return ParsedTools("")
            return ParsedTools(content_of([text]))
        try:
            return ParsedTools("", self._calls(body, final))
        except Malformed:
            return ParsedTools(content_of([text]))

    def _calls(self, body: str, final: bool) -> list[ParsedCall]:
        if final:
            return [_call(node, self.names) for node in _list_of_calls(body)]
        calls: list[ParsedCall] = []
        for element, complete in _elements(body):
            if complete:
                calls.append(_call(_one_call(element), self.names))
                continue
            m = _NAME.match(element)
            if m is not None:
                calls.append(ParsedCall(check_name(m.group(1), self.names), ""))
            elif element.strip() and not re.fullmatch(r"\s*[A-Za-z_][\w.]*\s*", element):
                raise Malformed("expected a call")
        return calls


def _list_of_calls(body: str) -> list[ast.Call]:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        raise Malformed("not Python") from None
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
        raise Malformed("not a list of calls")
    return list(tree.elts)  # type: ignore[arg-type]


def _one_call(element: str) -> ast.Call:
    nodes = _list_of_calls("[" + element + "]")
    if len(nodes) != 1:
        raise Malformed("expected one call")
    return nodes[0]


def _call(node: ast.Call, names: frozenset[str]) -> ParsedCall:
    if node.args or not node.func or any(k.arg is None for k in node.keywords):
        raise Malformed("only keyword arguments")
    name = check_name(ast.unparse(node.func), names)
    try:
        args: dict[str, Any] = {k.arg: ast.literal_eval(k.value) for k in node.keywords}  # type: ignore[misc]
        text = json.dumps(args, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError):
        raise Malformed("arguments that are no literals") from None
    return ParsedCall(name, text)


def _elements(body: str) -> list[tuple[str, bool]]:
    """The list's elements so far, each with whether it is complete (a `,` or `]` followed it)."""
    out: list[tuple[str, bool]] = []
    depth, quote, start, i = 0, "", 1, 1
    while i < len(body):
        c = body[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c != "]":
                    raise Malformed("unbalanced")
                if body[start:i].strip():
                    out.append((body[start:i], True))
                if body[i + 1:].strip():
                    raise Malformed("text after the list")
                return out
            depth -= 1
        elif c == "," and depth == 0:
            out.append((body[start:i], True))
            start = i + 1
        i += 1
    if body[start:].strip():
        out.append((body[start:], False))
    return out
