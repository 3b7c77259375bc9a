"""Priority scheduling through a real `forerun serve --scheduling-policy priority`: the body's `priority` orders
the queue, and bad values get an OpenAI-style 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serve_helpers import serving


@pytest.fixture(scope="module")
def priority_server(tiny_llama_dir):
    # One request at a time: whoever the scheduler admits next runs alone until it ends.
    yield from serving(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "1024",
                       "--num-kv-blocks", "256", "--block-size", "16", "--max-num-seqs", "1",
                       "--scheduling-policy", "priority")


def body(prompt_base: int, max_tokens: int, priority: object, stream: bool = True) -> dict:
    return {"model": "tiny", "prompt": [prompt_base + i for i in range(8)], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream, "priority": priority}


async def _scenario(base_url: str) -> tuple[list[tuple[str, str]], float]:
    """A long blocker holds the only slot; `low` (priority 10) then `high` (priority -1) queue behind it; once
    both wait, the blocker's client leaves. Returns the order of streamed events and the waiting count seen."""
    events: list[tuple[str, str]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        first_token = asyncio.Event()

        async def stream(name: str, b: dict) -> None:
            async with client.stream("POST", "/v1/completions", json=b) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    msg = json.loads(line[5:])
                    assert "error" not in msg, msg
                    if msg.get("choices"):
                        events.append((name, "finish" if msg["choices"][0].get("finish_reason") else "token"))
                        first_token.set()

        blocker = asyncio.create_task(stream("blocker", body(100, 1000, 0)))
        await first_token.wait()
        low = asyncio.create_task(stream("low", body(300, 4, 10)))
        await asyncio.sleep(0)
        high = asyncio.create_task(stream("high", body(500, 30, -1)))
        waiting = 0.0
        for _ in range(600):  # until both wait behind the blocker (each poll asks the core for fresh stats)
            text = (await client.get("/metrics")).text
            waiting = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("forerun:num_requests_waiting"))
            if waiting >= 2 or blocker.done():
                break
            await asyncio.sleep(0.05)
        blocker.cancel()  # the client leaves: the server aborts the blocker and frees the slot
        await asyncio.gather(blocker, return_exceptions=True)
        await asyncio.gather(low, high)
    return events, waiting


def test_priority_orders_the_queue_through_the_server(priority_server):
    events, waiting = asyncio.run(_scenario(priority_server.base_url))
    assert waiting == 2, "both requests should have waited behind the blocker"
    assert ("blocker", "finish") not in events  # it was still running when the two queued
    firsts = [name for name, kind in events if name != "blocker"]
    # max_num_seqs=1: `high` arrived second but runs first; `low` starts only after high's 30 tokens.
    assert firsts[0] == "high" and firsts.count("high") > 1 and firsts[-1] == "low"
    assert ("high", "finish") in events and ("low", "finish") in events


@pytest.mark.parametrize("priority", ["urgent", 1.5, None])
def test_bad_priority_is_a_400(priority_server, priority):
    r = httpx.post(f"{priority_server.base_url}/v1/completions", json=body(100, 4, priority, stream=False),
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"
