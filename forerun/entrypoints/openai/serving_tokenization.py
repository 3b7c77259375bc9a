"""POST /tokenize and /detokenize (vLLM's routes): the server's own tokenizer and chat template, so a
client counts tokens exactly as the engine will."""

from __future__ import annotations

import asyncio
from typing import Any

from forerun.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, OpenAIModel, RequestModel
from forerun.entrypoints.openai.protocol_tools import ChatTool
from forerun.entrypoints.openai.serving_base import ServingBase
from forerun.entrypoints.openai.serving_chat import OpenAIServingChat
from forerun.entrypoints.openai.tool_prompt import template_inputs


class TokenizeRequest(RequestModel):
    """Exactly one of `prompt` (text, tokenized as /v1/completions does) or `messages` (rendered by the
    chat template, as /v1/chat/completions does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class OpenAIServingTokenization(ServingBase):
    """Invariant: /tokenize gives the ids the generation routes would send the engine for the same input."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        super().__init__(chat.engine, chat.names, chat.metrics)
        self.chat = chat

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_request(req)
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if req.prompt is not None:
            if req.tools is not None:
                raise ValueError("tools: only with messages")
            self.limit.check("prompt", len(req.prompt))
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            [ids] = await self.limit.encode([req.prompt], add_special_tokens=add_special)
        else:
            text = await self._render(req)
            [ids] = await self.limit.encode([text], add_special_tokens=bool(req.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def _render(self, req: TokenizeRequest) -> str:
        chat_req = ChatCompletionRequest(messages=req.messages or [], add_generation_prompt=req.add_generation_prompt,
                                         chat_template_kwargs=req.chat_template_kwargs)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        messages, tools = template_inputs(chat_req.message_dicts(), tools, self.chat.template_takes_tools)
        self.limit.check("messages", sum(len(m["content"]) for m in messages))
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, self.chat.render, chat_req, messages, tools)
        self.limit.check("messages", len(text))
        return text

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(req)
        size = self.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise ValueError(f"tokens: {bad} is not a token id of this vocabulary (size {size})")
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, self.tokenizer.decode, req.tokens, False)
        return DetokenizeResponse(prompt=text)
