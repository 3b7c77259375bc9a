"""A small raw SSE client for the robustness tests: what one streamed request got, and how it ended.

Raw httpx rather than the openai client, so a test can drop the connection after any event and see
error events exactly as the server sent them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int | None = None  # from the usage chunk, when the stream got that far
    tokens_seen: int = 0  # tokens counted from per-chunk logprobs (completions with logprobs=0)
    events: int = 0  # data events with a choice
    done: bool = False  # saw `data: [DONE]`
    error: dict[str, Any] | None = None  # an error event, or a transport error as {"transport": ...}
    status: int = 0
    cancelled: bool = False  # the client dropped the connection on purpose
    ended_at: float = 0.0  # time.monotonic() when the stream ended, however it ended


def _apply(result: StreamResult, chunk: dict[str, Any], chat: bool) -> None:
    if "error" in chunk:
        result.error = chunk["error"]
        return
    if chunk.get("usage"):
        result.completion_tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices", []):
        result.events += 1
        result.text += (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
        if choice.get("finish_reason"):
            result.finish_reasons.append(choice["finish_reason"])
        logprobs = choice.get("logprobs")
        if not chat and logprobs:
            result.tokens_seen += len(logprobs.get("tokens", []))


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], cancel_after: int | None = None,
                 timeout_s: float = 60.0) -> StreamResult:
    """POST `body` with stream=true; with `cancel_after`, close the connection after that many choice events."""
    result = StreamResult()
    chat = path.endswith("/chat/completions")
    try:
        async with client.stream("POST", path, json={**body, "stream": True}, timeout=timeout_s) as r:
            result.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                try:
                    result.error = r.json()["error"]
                except (ValueError, KeyError, TypeError):  # not OpenAI-shaped: keep what came, for the assert
                    result.error = {"status": r.status_code, "body": r.text[:200]}
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result.done = True
                    break
                _apply(result, json.loads(line[6:]), chat)
                if cancel_after is not None and result.events >= cancel_after:
                    result.cancelled = True
                    break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        result.error = {"transport": repr(exc)}
    finally:
        result.ended_at = time.monotonic()
    return result


async def whole(client: httpx.AsyncClient, path: str, body: dict[str, Any], timeout_s: float = 60.0
                ) -> tuple[str, str | None]:
    """Text and finish reason of a non-streamed request (one choice)."""
    plain = {k: v for k, v in body.items() if k != "stream_options"}  # refused without stream=true
    r = await client.post(path, json={**plain, "stream": False}, timeout=timeout_s)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"]
