"""Pieces both OpenAI endpoints share: model check, request timing, SSE framing, disconnect handling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from forerun.engine.async_llm import AsyncLLM
from forerun.engine.input_processor import Prompt
from forerun.entrypoints.openai.input_checks import TextLimit, check_unicode
from forerun.entrypoints.openai.metrics import ServerMetrics
from forerun.entrypoints.openai.model_names import ServedModelNames
from forerun.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs
from forerun.outputs import RequestOutput
from forerun.sampling_params import SamplingParams

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


class EngineRequestError(RuntimeError):
    """The engine ended a request with an error (a failed step): the server's fault, not the client's."""


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


class ServingBase:
    """Invariants: every request this class starts is observed in the metrics once, when it finishes;
    no text is tokenized before `check_request` passed and its size was checked against `limit`, and
    none is tokenized on the event loop."""

    def __init__(self, engine: AsyncLLM, names: ServedModelNames, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.names = names
        self.model_name = names.primary
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.limit = TextLimit(engine.tokenizer, engine.max_model_len)

    def check_request(self, req: BaseModel) -> None:
        """Valid Unicode everywhere (first: an error echoing bad text could not be encoded), then the model."""
        check_unicode(req)
        self.names.check(getattr(req, "model", None))

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """The engine's stream, timed for the metrics; a completion that ended in error raises."""
        t0 = time.monotonic()
        first: float | None = None
        async for out in self.engine.generate(prompt, params, request_id, priority):
            if first is None and any(c.delta_token_ids for c in out.outputs):
                first = time.monotonic()
            for c in out.outputs:
                if c.finish_reason == "error":
                    raise EngineRequestError(f"engine error: {c.error}")
            if out.finished:
                longest = max(len(c.token_ids) for c in out.outputs)
                self.metrics.observe_request(out.outputs[0].finish_reason or "stop", len(out.prompt_token_ids),
                                             longest, None if first is None else first - t0, time.monotonic() - t0)
            yield out

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_label(self, token_id: int, as_ids: bool) -> str:
        """How a logprobs entry names a token: its text, or vLLM's `token_id:N` with
        `return_tokens_as_token_ids` (some tokens are no whole character of text)."""
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    def prompt_logprobs(self, out: RequestOutput, as_ids: bool) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` of a finished output: the prompt token's own rank, and each top-k
        token's rank from its place in the entry (ties keep the first place)."""
        if out.prompt_logprobs is None:
            return None
        ranks = out.prompt_ranks or [None] * len(out.prompt_logprobs)
        result: PromptLogprobs = []
        for tid, entry, rank in zip(out.prompt_token_ids, out.prompt_logprobs, ranks):
            if entry is None:
                result.append(None)
                continue
            values = sorted(entry.values(), reverse=True)
            result.append({str(t): PromptLogprob(logprob=lp, rank=rank if t == tid else values.index(lp) + 1,
                                                 decoded_token=self.token_label(t, as_ids))
                           for t, lp in entry.items()})
        return result


def top_logprobs(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one position (the entry holds the sampled token plus the top k)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several streams as their items arrive, tagged with the stream's index.

    Leaving early (or an error in one stream) cancels the others, which aborts their requests.
    """
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None, False))
            await queue.put((i, None, None, True))
        except Exception as exc:
            await queue.put((i, None, exc, True))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                remaining -= 1
            else:
                yield i, item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def indexed(stream: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    async for item in stream:
        yield 0, item


async def run_until_disconnect(raw: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and so aborting its requests) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientDisconnected()


async def _wait_disconnect(raw: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
