"""`qwen3_xml`: Qwen3-Coder's calls, one XML-like block per call, one element per parameter.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are plain text, turned into JSON by the type the tool's schema gives the parameter
(integer, number, boolean, object, array; anything else stays a string). The arguments string is built
one parameter at a time, so a stream sends `{"city": "Paris"`, then `, "days": 3`, then `}`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from forerun.entrypoints.openai.tool_parsers.base import (Malformed, ParsedCall, ParsedTools, ToolParser,
                                                          check_name, tagged_calls)

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_FUNCTION_END = re.compile(r"\s*</function>")


class Qwen3XmlToolParser(ToolParser):
    """Invariant: see ToolParser; a block without `</function>` at the end is content."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        return tagged_calls(text, final, START, END, self._call)

    def _call(self, body: str, whole: bool) -> ParsedCall | None:
        m = _FUNCTION.match(body)
        if m is None:
            if whole or (body.strip() and not _could_start(body.lstrip(), "<function=")):
                raise Malformed("expected <function=...>")
            return None
        name = check_name(m.group(1).strip(), self.names)
        schema = self.tools[name].parameters
        pieces: list[str] = []
        i = m.end()
        while True:
            p = _PARAM.match(body, i)
            if p is None:
                break
            key = p.group(1).strip()
            value = _typed(p.group(2), _param_type(schema, key))
            pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            i = p.end()
        args = "{" + ", ".join(pieces)
        if _FUNCTION_END.match(body, i):
            if body[_FUNCTION_END.match(body, i).end():].strip():  # type: ignore[union-attr]
                raise Malformed("text after </function>")
            return ParsedCall(name, args + "}")
        rest = body[i:].lstrip()
        if whole or not (_could_start(rest, "<parameter=") or _could_start(rest, "</function>")):
            raise Malformed("expected <parameter=...> or </function>")
        return ParsedCall(name, args)


def _could_start(text: str, tag: str) -> bool:
    """Whether `text` (an element still being written) may become one starting with `tag`."""
    return text.startswith(tag) or tag.startswith(text)


def _param_type(schema: dict[str, Any], key: str) -> str | None:
    prop = (schema.get("properties") or {}).get(key)
    if not isinstance(prop, dict):
        return None
    kind = prop.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def _typed(raw: str, kind: str | None) -> Any:
    """The JSON value of a parameter's text; text that is no value of its type stays a string."""
    text = raw.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return raw
        if kind in ("object", "array") or kind is None and text[:1] in "{[":
            return json.loads(text)
    except ValueError:
        return raw
    if kind is None and text == "null":
        return None
    return raw
