"""POST /v1/chat/completions: render the chat template, generate, answer as the assistant."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forerun.engine.async_llm import AsyncLLM
from forerun.entrypoints.openai.chat_output import DeltaTracker, MessageParser
from forerun.entrypoints.openai.errors import sse_error
from forerun.entrypoints.openai.metrics import ServerMetrics
from forerun.entrypoints.openai.model_names import ServedModelNames
from forerun.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                                 ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                                 ChatStreamChoice, ChatTokenLogprob, DeltaMessage, TopLogprob,
                                                 UsageInfo)
from forerun.entrypoints.openai.protocol_base import random_id
from forerun.entrypoints.openai.serving_base import (SSE_DONE, ClientDisconnected, ServingBase,
                                                     run_until_disconnect, sse, top_logprobs)
from forerun.entrypoints.openai.tool_prompt import template_inputs
from forerun.entrypoints.openai.tool_request import ChatParsing, ToolPlan, plan_tools, tools_text_size
from forerun.outputs import CompletionOutput, RequestOutput
from forerun.sampling_params import SamplingParams


# Template variables the request's own fields set; passed again they would clash (TypeError).
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools"})


class OpenAIServingChat(ServingBase):
    """The prompt is the template's text encoded without extra special tokens (the template holds them).

    Invariant: a response's message and the concatenated deltas of the same stream are the same parse
    of the same text (see chat_output), whatever the tool and reasoning parsers.
    """

    def __init__(self, engine: AsyncLLM, names: ServedModelNames, metrics: ServerMetrics,
                 parsing: ChatParsing | None = None) -> None:
        super().__init__(engine, names, metrics)
        self.parsing = parsing or ChatParsing()
        self.template_takes_tools = self.tokenizer.chat_template_takes_tools()

    def render(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text; ValueError naming the field when the template cannot render this request."""
        kwargs = req.chat_template_kwargs or {}
        clash = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if clash:
            raise ValueError(f"chat_template_kwargs: {clash} are set by the request's own fields, not here")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      tools=tools, **kwargs)
        except ValueError:
            raise
        except Exception as exc:  # the template is user-facing code: whatever it raises is about this input
            field = "chat_template_kwargs" if kwargs else "messages"
            raise ValueError(f"{field}: the chat template could not render this request ({exc!r})") from None
        return text

    async def prompt_ids(self, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        """Size-checked before rendering (the messages' and tools' text) and before tokenizing (the rendered
        text, which template kwargs may have grown); both run on a worker thread."""
        messages, tools = template_inputs(req.message_dicts(), plan.prompt_tools, self.template_takes_tools)
        self.limit.check("messages", sum(len(m["content"]) for m in messages) + tools_text_size(tools))
        text = await asyncio.get_running_loop().run_in_executor(None, self.render, req, messages, tools)
        self.limit.check("messages", len(text))
        [ids] = await self.limit.encode([text], add_special_tokens=False)
        return ids

    def _sampling_params(self, req: ChatCompletionRequest, plan: ToolPlan) -> SamplingParams:
        params = req.sampling_params(req.max_output_tokens, req.num_logprobs)
        schema = plan.constraint()
        if schema is None:
            return params
        from forerun.structured.spec import StructuredOutputsParams
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))

    def _message_parser(self, plan: ToolPlan) -> MessageParser:
        # A forced call starts at the first token (its grammar leaves no room to think first).
        forced = plan.mode in ("required", "named")
        reasoning = None if forced else self.parsing.new_reasoning_parser()
        return MessageParser(reasoning, plan.parser(self.parsing), plan.single_call)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        try:
            if req.stream:
                plan, rid, stream = await self._start(req)
                # Wait for the first output so bad input still gets a plain 400, not a broken stream.
                first = await run_until_disconnect(raw, _first(stream, plan))
                return StreamingResponse(self._stream(req, plan, rid, first, stream), media_type="text/event-stream")
            return JSONResponse((await self.complete(req, raw)).model_dump())
        except ClientDisconnected:
            return Response(status_code=499)

    async def complete(self, req: ChatCompletionRequest, raw: Request) -> ChatCompletionResponse:
        """The whole response to a request that is not streamed; raises ClientDisconnected."""
        plan, rid, stream = await self._start(req)
        final = await run_until_disconnect(raw, _last(stream, plan))
        return self._response(req, plan, rid, final)

    async def _start(self, req: ChatCompletionRequest) -> tuple[ToolPlan, str, AsyncIterator[RequestOutput]]:
        self.check_request(req)
        req.check_function_call()
        plan = plan_tools(req, self.parsing)
        params = self._sampling_params(req, plan)
        prompt = await self.prompt_ids(req, plan)
        rid = random_id("chatcmpl")
        return plan, rid, self.generate(prompt, params, rid, req.priority)

    def _response(self, req: ChatCompletionRequest, plan: ToolPlan, rid: str, out: RequestOutput
                  ) -> ChatCompletionResponse:
        parser = self._message_parser(plan)
        choices = []
        for c in out.outputs:
            parsed = parser.parse(c.text, final=True, cut=c.finish_reason == "length")
            calls = parser.tool_calls(parsed)
            message = AssistantMessage(content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=calls)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=self._logprobs(c.token_ids, c.logprobs, req.num_logprobs,
                                                              req.return_tokens_as_token_ids),
                                      finish_reason=_finish_reason(c, bool(calls)), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=_usage(out),
                                      prompt_logprobs=self.prompt_logprobs(out, req.return_tokens_as_token_ids))

    async def _stream(self, req: ChatCompletionRequest, plan: ToolPlan, rid: str, first: RequestOutput,
                      rest: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        created = int(time.time())
        parser = self._message_parser(plan)
        trackers: dict[int, DeltaTracker] = {}

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        try:
            for c in first.outputs:
                trackers[c.index] = DeltaTracker()
                yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
            out: RequestOutput | None = first
            final = first
            ended: set[int] = set()  # completions whose finish chunk was sent
            while out is not None:
                final = out
                for c in out.outputs:
                    tracker = trackers.setdefault(c.index, DeltaTracker())
                    lp = None
                    if c.logprobs is not None and c.delta_token_ids:
                        n = len(c.delta_token_ids)
                        lp = self._logprobs(c.delta_token_ids, c.logprobs[len(c.logprobs) - n:], req.num_logprobs,
                                            req.return_tokens_as_token_ids)
                    if parser.passthrough:
                        delta = DeltaMessage(content=c.delta_text) if c.delta_text or c.delta_token_ids else None
                    else:
                        delta = tracker.delta(parser.parse(c.text, final=c.finished, cut=c.finish_reason == "length"))
                    if delta is not None or lp is not None:
                        yield chunk([ChatStreamChoice(index=c.index, delta=delta or DeltaMessage(), logprobs=lp)])
                    if c.finished and c.index not in ended:
                        ended.add(c.index)
                        reason = _finish_reason(c, tracker.num_calls > 0)
                        yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason)])
                out = await anext(rest, None)
            if req.include_usage:
                yield chunk([], _usage(final))
        except Exception as exc:
            yield sse_error(exc)
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None, k: int | None,
                  as_ids: bool = False) -> ChatLogprobs | None:
        if k is None or entries is None:
            return None
        content = []
        for tid, entry in zip(token_ids, entries):
            text = self.token_label(tid, as_ids)
            tops = [TopLogprob(token=self.token_label(t, as_ids), logprob=lp, bytes=list(self.token_label(t, as_ids).encode()))
                    for t, lp in top_logprobs(entry, k)]
            content.append(ChatTokenLogprob(token=text, logprob=entry.get(tid, float("-inf")),
                                            bytes=list(text.encode()), top_logprobs=tops))
        return ChatLogprobs(content=content)


def _usage(out: RequestOutput) -> UsageInfo:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _finish_reason(c: CompletionOutput, made_calls: bool) -> str | None:
    """"tool_calls" when the model stopped by itself after calling; a cut ("length") stays what it is."""
    return "tool_calls" if made_calls and c.finish_reason == "stop" else c.finish_reason


async def _first(stream: AsyncIterator[RequestOutput], plan: ToolPlan) -> RequestOutput:
    async with _SchemaErrors(plan):
        return await anext(stream)


async def _last(stream: AsyncIterator[RequestOutput], plan: ToolPlan) -> RequestOutput:
    final = None
    async with _SchemaErrors(plan):
        async for out in stream:
            final = out
    assert final is not None and final.finished
    return final


class _SchemaErrors:
    """A forced call's grammar is built from the tools: the backend's refusal of it is about `tools`,
    not about the `structured_outputs` field the request never sent."""

    def __init__(self, plan: ToolPlan) -> None:
        self.forced = plan.mode in ("required", "named")

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        if self.forced and isinstance(exc, ValueError) and str(exc).startswith("structured_outputs"):
            detail = str(exc).split(":", 1)[-1].strip()
            raise ValueError(f"tools: a parameters schema cannot be used for a forced call: {detail}") from None
        return False
