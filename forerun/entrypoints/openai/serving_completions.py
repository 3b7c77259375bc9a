"""POST /v1/completions: one or more prompts, `n` completions each, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forerun.entrypoints.openai.errors import sse_error
from forerun.entrypoints.openai.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                                                 CompletionRequest, CompletionResponse, UsageInfo)
from forerun.entrypoints.openai.protocol_base import random_id
from forerun.entrypoints.openai.serving_base import (SSE_DONE, ClientDisconnected, ServingBase, indexed, merge,
                                                     run_until_disconnect, sse, top_logprobs)
from forerun.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(ServingBase):
    """Choice `i * n + j` is completion j of prompt i, as in OpenAI's API."""

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        prompts = req.prompts()
        params = req.sampling_params(req.max_tokens, req.logprobs)
        prompt_ids = await self._tokenize(prompts, many=not isinstance(req.prompt, str))
        rid = random_id("cmpl")
        gens = [self.generate(p, params, f"{rid}-{i}", req.priority) for i, p in enumerate(prompt_ids)]
        stream = merge(gens) if len(gens) > 1 else indexed(gens[0])
        try:
            if req.stream:
                # Wait for the first output so bad input still gets a plain 400, not a broken stream.
                first = await run_until_disconnect(raw, anext(stream))
                return StreamingResponse(self._stream(req, rid, first, stream, prompts),
                                         media_type="text/event-stream")
            finals = await run_until_disconnect(raw, _collect(stream))
        except ClientDisconnected:
            return Response(status_code=499)
        response = self._response(req, rid, [finals[i] for i in range(len(prompts))], prompts)
        return JSONResponse(response.model_dump())

    def _echo(self, req: CompletionRequest, prompt: str | list[int]) -> str:
        """What `echo` puts before a completion: the prompt as sent (token ids decoded, special tokens kept)."""
        if not req.echo:
            return ""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    async def _tokenize(self, prompts: list[str | list[int]], many: bool) -> list[list[int]]:
        """Token ids of every prompt: text is size-checked, then tokenized on a worker thread, as the
        engine would (with the tokenizer's special tokens)."""
        texts: list[str] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                field = f"prompt[{i}]" if many else "prompt"
                if not p:
                    raise ValueError(f"{field}: must not be empty")
                self.limit.check(field, len(p))
                texts.append(p)
        encoded = iter(await self.limit.encode(texts) if texts else [])
        return [next(encoded) if isinstance(p, str) else p for p in prompts]

    def _response(self, req: CompletionRequest, rid: str, finals: list[RequestOutput],
                  prompts: list[str | list[int]]) -> CompletionResponse:
        choices, usage = [], UsageInfo()
        for i, out in enumerate(finals):
            usage.prompt_tokens += len(out.prompt_token_ids)
            echo = self._echo(req, prompts[i])
            prompt_lps = self.prompt_logprobs(out, req.return_tokens_as_token_ids)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                lp = self._logprobs(c.token_ids, c.logprobs, req.logprobs, 0, req.return_tokens_as_token_ids)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=echo + c.text, logprobs=lp,
                                                prompt_logprobs=prompt_lps,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)

    async def _stream(self, req: CompletionRequest, rid: str, first: tuple[int, RequestOutput],
                      rest: AsyncIterator[tuple[int, RequestOutput]], prompts: list[str | list[int]]
                      ) -> AsyncIterator[str]:
        created = int(time.time())
        usage = UsageInfo()
        offsets: dict[int, int] = {}  # choice index -> characters streamed so far (for text_offset)
        ended: set[int] = set()  # choice indexes whose finish_reason was sent
        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                i, out = item
                for c in out.outputs:
                    index = i * req.n + c.index
                    if not (c.delta_text or c.delta_token_ids or (c.finished and index not in ended)):
                        continue
                    if c.finished:
                        ended.add(index)
                    text = c.delta_text
                    if index not in offsets:  # this choice's first chunk
                        text = self._echo(req, prompts[i]) + text
                    lp = self._delta_logprobs(c, req.logprobs, offsets.get(index, 0), req.return_tokens_as_token_ids)
                    offsets[index] = offsets.get(index, 0) + len(c.delta_text)
                    choice = CompletionChoice(index=index, text=text, logprobs=lp,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    yield sse(CompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice]))
                if out.finished:
                    usage.prompt_tokens += len(out.prompt_token_ids)
                    usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                item = await anext(rest, None)
            if req.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse(CompletionChunk(id=rid, created=created, model=self.model_name, choices=[], usage=usage))
        except Exception as exc:
            yield sse_error(exc)
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE

    def _delta_logprobs(self, c: CompletionOutput, k: int | None, offset: int, as_ids: bool
                        ) -> CompletionLogprobs | None:
        if k is None or c.logprobs is None:
            return None
        n = len(c.delta_token_ids)
        return self._logprobs(c.delta_token_ids, c.logprobs[len(c.logprobs) - n:], k, offset, as_ids)

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None, k: int | None,
                  offset: int, as_ids: bool = False) -> CompletionLogprobs | None:
        if k is None or entries is None:
            return None
        out = CompletionLogprobs()
        for tid, entry in zip(token_ids, entries):
            text = self.token_text(tid)
            out.tokens.append(self.token_label(tid, as_ids))
            out.token_logprobs.append(entry.get(tid))
            out.top_logprobs.append({self.token_label(t, as_ids): lp for t, lp in top_logprobs(entry, max(k, 1))})
            out.text_offset.append(offset)
            offset += len(text)
        return out


async def _collect(stream: AsyncIterator[tuple[int, RequestOutput]]) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in stream:
        if out.finished:
            finals[i] = out
    return finals
