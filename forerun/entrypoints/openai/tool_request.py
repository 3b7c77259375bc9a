"""What one chat request asks of tools: checked fields, the mode, the grammar of a forced call, the parser.

`tool_choice`:
- "none": plain text; the tools are left out of the prompt.
- "auto" (the default when tools are given): the model chooses; `--tool-call-parser` extracts its calls.
  Needs the server started with `--enable-auto-tool-choice`, as in vLLM.
- "required": at least one call. Generated under a JSON-schema grammar, as vLLM does: a JSON array of
  `{"name": <a tool's name>, "parameters": <that tool's schema>}` (at most one item when
  `parallel_tool_calls` is false), so even a small model makes valid calls.
- a named function: one call of it; the grammar is its parameters schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from forerun.entrypoints.openai.protocol import ChatCompletionRequest
from forerun.entrypoints.openai.protocol_tools import NamedToolChoice
from forerun.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from forerun.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, ToolSpec
from forerun.entrypoints.openai.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from forerun.entrypoints.openai.tool_schema import check_parameters

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsing options (`--tool-call-parser`, `--enable-auto-tool-choice`,
    `--reasoning-parser`). Invariant: the parser names are known ones."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: unknown parser {self.tool_call_parser!r}; "
                             f"choose one of {sorted(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: unknown parser {self.reasoning_parser!r}; "
                             f"choose one of {sorted(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice: needs --tool-call-parser to name the model's call format")

    def new_reasoning_parser(self) -> ReasoningParser | None:
        return None if self.reasoning_parser is None else REASONING_PARSERS[self.reasoning_parser]()


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools. Invariant: `tools` is empty exactly when mode is "none" and no tools were
    given; `named` is set exactly in "named" mode and names one of `specs`."""

    mode: Mode
    specs: list[ToolSpec] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # as given, for the chat template
    named: str | None = None
    single_call: bool = False

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none for "none", so that the answer is text."""
        return self.tools if self.mode != "none" and self.tools else None

    def constraint(self) -> dict[str, Any] | None:
        """The JSON schema a forced call is generated under (None when the model chooses)."""
        if self.mode == "named":
            return next(s.parameters for s in self.specs if s.name == self.named)
        if self.mode != "required":
            return None
        schemas = [_hoist_defs(s.parameters, f"t{i}_") for i, s in enumerate(self.specs)]
        defs: dict[str, Any] = {}
        items = []
        for spec, (params, tool_defs) in zip(self.specs, schemas):
            defs.update(tool_defs)
            items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [spec.name]},
                                                           "parameters": params},
                          "required": ["name", "parameters"]})
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if self.single_call:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        return array

    def parser(self, parsing: ChatParsing) -> ToolParser | None:
        if self.mode == "named":
            assert self.named is not None
            return NamedCallParser(self.named)
        if self.mode == "required":
            return RequiredCallsParser()
        if self.mode == "auto":
            assert parsing.tool_call_parser is not None
            return TOOL_PARSERS[parsing.tool_call_parser](self.specs)
        return None


def plan_tools(req: ChatCompletionRequest, parsing: ChatParsing) -> ToolPlan:
    """The request's tools, checked; ValueError naming the field for any bad part."""
    specs = _specs(req)
    choice = req.parsed_tool_choice()
    single = req.parallel_tool_calls is False
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    if choice is None:
        choice = "auto" if specs else "none"
    if choice == "none":
        return ToolPlan("none", specs, tools)
    if not specs:
        raise ValueError("tool_choice: needs tools; without them only \"none\" is accepted")
    constrained = (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs
    if constrained and choice != "auto":
        raise ValueError("tool_choice: a forced call cannot also follow response_format or structured_outputs")
    if choice == "auto":
        if not parsing.enable_auto_tool_choice:
            raise ValueError("tool_choice: \"auto\" (the default when tools are given) needs the server started "
                             "with --enable-auto-tool-choice and --tool-call-parser; or send \"required\", a "
                             "named function, or \"none\"")
        return ToolPlan("auto", specs, tools, single_call=single)
    if choice == "required":
        return ToolPlan("required", specs, tools, single_call=single)
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in {s.name for s in specs}:
        raise ValueError(f"tool_choice.function.name: no tool named {name!r}; the tools are "
                         f"{[s.name for s in specs]}")
    return ToolPlan("named", specs, tools, named=name, single_call=True)


def _specs(req: ChatCompletionRequest) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        fn = tool.function
        where = f"tools[{i}].function"
        if not _FUNCTION_NAME.fullmatch(fn.name):
            raise ValueError(f"{where}.name: {fn.name!r} must be 1 to 64 letters, digits, '_' or '-'")
        if fn.name in seen:
            raise ValueError(f"{where}.name: {fn.name!r} is offered twice")
        seen.add(fn.name)
        parameters = EMPTY_PARAMETERS if fn.parameters is None else fn.parameters
        check_parameters(parameters, f"{where}.parameters")
        specs.append(ToolSpec(fn.name, parameters))
    return specs


_REF = re.compile(r"^#/(\$defs|definitions)/")


def _hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`schema` without its `$defs`/`definitions`, which are returned renamed with `prefix` (and its
    `$ref`s rewritten to match): inside the array of calls, a tool's `#/$defs/...` would otherwise point
    at the array's root."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not defs:
        return schema, {}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    renamed = {prefix + name: _rewrite_refs(sub, prefix) for name, sub in defs.items()}
    return _rewrite_refs(body, prefix), renamed


def _rewrite_refs(value: Any, prefix: str) -> Any:
    if isinstance(value, dict):
        out = {k: _rewrite_refs(v, prefix) for k, v in value.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and _REF.match(ref):
            out["$ref"] = "#/$defs/" + prefix + _REF.sub("", ref)
        return out
    if isinstance(value, list):
        return [_rewrite_refs(v, prefix) for v in value]
    return value


def tools_text_size(tools: list[dict[str, Any]] | None) -> int:
    """Characters the tools given to the template add to the prompt at most (for the size check before
    rendering; tools spelled out in a system message are counted with the messages)."""
    return len(json.dumps(tools)) if tools else 0
