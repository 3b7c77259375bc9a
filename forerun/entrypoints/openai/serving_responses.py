"""POST /v1/responses: OpenAI's Responses API for plain text and function tools, as a thin layer over chat.

The request becomes a chat request (instructions as the system message, input items as messages,
`function_call` items as an assistant's tool calls, `function_call_output` items as tool messages),
and the chat response becomes output items (`reasoning`, `message`, `function_call`). Nothing is stored:
`store: true`, `previous_response_id` and streaming are refused with a 400 naming the field.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from forerun.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from forerun.entrypoints.openai.protocol_base import OpenAIModel, RequestModel, random_id
from forerun.entrypoints.openai.serving_base import ClientDisconnected
from forerun.entrypoints.openai.serving_chat import OpenAIServingChat

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesTool(RequestModel):
    """A function tool, flat as the Responses API writes it."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    user: str | None = None


class ResponsesUsage(OpenAIModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponsesResponse(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    error: None = None
    model: str
    instructions: str | None = None
    output: list[dict[str, Any]]
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    temperature: float | None = None
    top_p: float | None = None
    usage: ResponsesUsage


class OpenAIServingResponses:
    """Invariant: a response is the chat response to the translated request, item for item."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        if req.stream:
            raise ValueError("stream: /v1/responses answers in one piece; stream with /v1/chat/completions")
        if req.store:
            raise ValueError("store: forerun keeps no responses; send store: false")
        chat_req = to_chat_request(req)
        try:
            out = await self.chat.complete(chat_req, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(from_chat_response(req, out).model_dump())


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in req.tools or []]
    body: dict[str, Any] = {"model": req.model, "messages": messages, "tools": tools or None, "tool_choice": choice,
                            "parallel_tool_calls": req.parallel_tool_calls, "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "user": req.user}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"input: {where}: {first.get('msg')}") from None


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], field: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _TEXT_PARTS]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ValueError(f"{field}.content: only text parts ({', '.join(_TEXT_PARTS)}) are supported")
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"{field}.content: must be text or a list of text parts")
        messages.append({"role": item.get("role", "user"), "content": content})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # calls made together form one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
    else:
        raise ValueError(f"{field}.type: {kind!r} is not supported (message, function_call, function_call_output)")


def from_chat_response(req: ResponsesRequest, out: ChatCompletionResponse) -> ResponsesResponse:
    choice = out.choices[0]
    message = choice.message
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append({"type": "reasoning", "id": random_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": message.reasoning_content}]})
    if message.content:
        items.append({"type": "message", "id": random_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message.content, "annotations": []}]})
    for call in message.tool_calls or []:
        items.append({"type": "function_call", "id": random_id("fc"), "call_id": call.id, "name": call.function.name,
                      "arguments": call.function.arguments, "status": "completed"})
    cut = choice.finish_reason == "length"
    usage = ResponsesUsage(input_tokens=out.usage.prompt_tokens, output_tokens=out.usage.completion_tokens,
                           total_tokens=out.usage.total_tokens)
    return ResponsesResponse(id=random_id("resp"), status="incomplete" if cut else "completed",
                             incomplete_details={"reason": "max_output_tokens"} if cut else None, model=out.model,
                             instructions=req.instructions, output=items,
                             parallel_tool_calls=req.parallel_tool_calls is not False,
                             tool_choice=req.tool_choice or "auto",
                             tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
                             temperature=req.temperature, top_p=req.top_p, usage=usage)
