"""POST /v1/chat/completions: render the chat template, generate, answer as the assistant."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forerun.entrypoints.openai.errors import sse_error
from forerun.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                                 ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                                 ChatStreamChoice, ChatTokenLogprob, DeltaMessage, TopLogprob,
                                                 UsageInfo, random_id)
from forerun.entrypoints.openai.serving_base import (SSE_DONE, ClientDisconnected, ServingBase,
                                                     run_until_disconnect, sse, top_logprobs)
from forerun.outputs import RequestOutput


# Template variables the request's own fields set; passed again they would clash (TypeError).
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt"})


class OpenAIServingChat(ServingBase):
    """The prompt is the template's text encoded without extra special tokens (the template holds them)."""

    def render(self, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
        """The prompt text; ValueError naming the field when the template cannot render this request."""
        kwargs = req.chat_template_kwargs or {}
        clash = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise ValueError(f"chat_template_kwargs: {clash} are set by the request's own fields, not here")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      **kwargs)
        except ValueError:
            raise
        except Exception as exc:  # the template is user-facing code: whatever it raises is about this input
            field = "chat_template_kwargs" if kwargs else "messages"
            raise ValueError(f"{field}: the chat template could not render this request ({exc!r})") from None
        return text

    async def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """Size-checked before rendering (the messages' text) and before tokenizing (the rendered text,
        which template kwargs may have grown); both run on a worker thread."""
        messages = req.message_dicts()
        self.limit.check("messages", sum(len(m["content"]) for m in messages))
        text = await asyncio.get_running_loop().run_in_executor(None, self.render, req, messages)
        self.limit.check("messages", len(text))
        [ids] = await self.limit.encode([text], add_special_tokens=False)
        return ids

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        req.check_tools()
        params = req.sampling_params(req.max_output_tokens, req.num_logprobs)
        prompt = await self.prompt_ids(req)
        rid = random_id("chatcmpl")
        stream = self.generate(prompt, params, rid, req.priority)
        try:
            if req.stream:
                # Wait for the first output so bad input still gets a plain 400, not a broken stream.
                first = await run_until_disconnect(raw, anext(stream))
                return StreamingResponse(self._stream(req, rid, first, stream), media_type="text/event-stream")
            final = await run_until_disconnect(raw, _last(stream))
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(self._response(req, rid, final).model_dump())

    def _response(self, req: ChatCompletionRequest, rid: str, out: RequestOutput) -> ChatCompletionResponse:
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              logprobs=self._logprobs(c.token_ids, c.logprobs, req.num_logprobs),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in out.outputs]
        return ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=_usage(out))

    async def _stream(self, req: ChatCompletionRequest, rid: str, first: RequestOutput,
                      rest: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        try:
            for c in first.outputs:
                yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
            out: RequestOutput | None = first
            final = first
            ended: set[int] = set()  # completions whose finish chunk was sent
            while out is not None:
                final = out
                for c in out.outputs:
                    if c.delta_text or c.delta_token_ids:
                        lp = None
                        if c.logprobs is not None:
                            n = len(c.delta_token_ids)
                            lp = self._logprobs(c.delta_token_ids, c.logprobs[len(c.logprobs) - n:], req.num_logprobs)
                        yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.delta_text),
                                                      logprobs=lp)])
                    if c.finished and c.index not in ended:
                        ended.add(c.index)
                        yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(),
                                                      finish_reason=c.finish_reason)])
                out = await anext(rest, None)
            if req.include_usage:
                yield chunk([], _usage(final))
        except Exception as exc:
            yield sse_error(exc)
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None, k: int | None
                  ) -> ChatLogprobs | None:
        if k is None or entries is None:
            return None
        content = []
        for tid, entry in zip(token_ids, entries):
            text = self.token_text(tid)
            tops = [TopLogprob(token=self.token_text(t), logprob=lp, bytes=list(self.token_text(t).encode()))
                    for t, lp in top_logprobs(entry, k)]
            content.append(ChatTokenLogprob(token=text, logprob=entry.get(tid, float("-inf")),
                                            bytes=list(text.encode()), top_logprobs=tops))
        return ChatLogprobs(content=content)


def _usage(out: RequestOutput) -> UsageInfo:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for out in stream:
        final = out
    assert final is not None and final.finished
    return final
