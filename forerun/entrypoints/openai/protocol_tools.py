"""Request and response bodies of tool calling (OpenAI's `tools`, `tool_choice`, `tool_calls`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from forerun.entrypoints.openai.protocol_base import OpenAIModel, RequestModel


class FunctionDefinition(RequestModel):
    """A tool's function; `parameters` is a JSON schema of an object (checked in `tool_request`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always follow the schema; auto calls are parsed, not forced


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class FunctionCallIn(RequestModel):
    name: str
    arguments: str  # JSON text of an object, as the server sent it


class ToolCallIn(RequestModel):
    """A call the assistant made earlier in the conversation, sent back with its result."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    """A call's first delta carries its id and name; later ones add pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    def model_post_init(self, _: Any) -> None:
        if self.id is not None:
            self.type = "function"


def call_dict(call: ToolCallIn, field: str) -> dict[str, Any]:
    """A past call as chat templates expect it: arguments as a dict (Hugging Face's convention)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError as exc:
        raise ValueError(f"{field}.function.arguments: not valid JSON ({exc})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{field}.function.arguments: must be a JSON object")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
