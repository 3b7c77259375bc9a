"""`forerun bench serve`: load any OpenAI-compatible server with streaming completions and report latency.

Prompts are random token-id lists (the completions API accepts them), so the input length is exact
without a tokenizer on the client. Arrivals follow a Poisson process at `--request-rate` (inf: all at
once), optionally capped at `--max-concurrency` requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

logger = logging.getLogger(__name__)

_JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]}


@dataclass
class RequestResult:
    """One request as the client saw it. `itl` holds the gaps between streamed chunks after the first."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="root URL of the server, without /v1 (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="model name sent in each request (default: the first model the server's /v1/models "
                             "lists)")
    parser.add_argument("--api-key", default=None,
                        help="sent as `Authorization: Bearer <key>` (default: none, no header)")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="where prompts come from; random: random token ids of --random-input-len tokens "
                             "(default: %(default)s)")
    parser.add_argument("--random-input-len", type=int, default=128,
                        help="prompt length of each request, in tokens (default: %(default)s)")
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="max_tokens of each request; with --ignore-eos every request generates exactly "
                             "this many (default: %(default)s)")
    parser.add_argument("--random-token-range", type=int, nargs=2, default=[100, 30000], metavar=("LOW", "HIGH"),
                        help="token ids of random prompts are drawn from [LOW, HIGH) (default: 100 30000)")
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="number of requests to send (default: %(default)s)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, arriving as a Poisson process; inf sends them all at once "
                             "(default: %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="the most requests in flight at once; others wait for one to finish, whatever "
                             "--request-rate says (default: no limit)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos (a vLLM extension), so requests generate past the end-of-sequence "
                             "token (default: off)")
    parser.add_argument("--structured-output-ratio", type=float, default=0.0,
                        help="fraction of requests, from 0 to 1, asking for a JSON schema via response_format "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts, the structured-request choice and the arrival times "
                             "(default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="per-request timeout in seconds (default: %(default)s)")
    parser.add_argument("--save-result", default=None, metavar="PATH",
                        help="also write the result JSON to this file (default: only the summary is printed)")
    parser.add_argument("--disable-tqdm", action="store_true", help="hide the progress bar (default: shown)")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark, print a summary, save JSON when asked, and return the result."""
    _validate(args)
    result = asyncio.run(_run(args))
    print(format_summary(result))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2))
    return result


def _validate(args: argparse.Namespace) -> None:
    for name in ("random_input_len", "random_output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"request_rate: must be > 0 (inf for all at once), got {args.request_rate}")
    if not 0.0 <= args.structured_output_ratio <= 1.0:
        raise ValueError(f"structured_output_ratio: must be in [0, 1], got {args.structured_output_ratio}")
    low, high = args.random_token_range
    if not 0 <= low < high:
        raise ValueError(f"random_token_range: need 0 <= LOW < HIGH, got {low} {high}")


def make_bodies(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    low, high = args.random_token_range
    num_structured = round(args.structured_output_ratio * args.num_prompts)
    structured = set(rng.sample(range(args.num_prompts), num_structured))
    bodies = []
    for i in range(args.num_prompts):
        body: dict[str, Any] = {
            "model": model, "prompt": [rng.randrange(low, high) for _ in range(args.random_input_len)],
            "max_tokens": args.random_output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            body["ignore_eos"] = True
        if i in structured:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": _JSON_SCHEMA}}
        bodies.append(body)
    return bodies


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model or await _first_model(client)
        bodies = make_bodies(args, model)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(bodies), desc="requests", disable=args.disable_tqdm, dynamic_ncols=True)
        gaps = np.random.default_rng(args.seed).exponential(1.0 / args.request_rate, len(bodies)) \
            if args.request_rate != float("inf") else np.zeros(len(bodies))

        async def one(body: dict[str, Any]) -> RequestResult:
            if sem is None:
                res = await _stream_one(client, body)
            else:
                async with sem:
                    res = await _stream_one(client, body)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for body, gap in zip(bodies, gaps):
            if gap > 0:
                await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(one(body)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(args, model, results, duration)


async def _first_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def _stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    res = RequestResult(prompt_len=len(body["prompt"]))
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"].get("message"))
                    return res
                if msg.get("usage"):
                    res.output_tokens = msg["usage"]["completion_tokens"]
                    res.prompt_len = msg["usage"]["prompt_tokens"]
                if not msg.get("choices") or not msg["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = repr(exc)
    return res


def _dist(name: str, values: list[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64) * 1000.0 if values else np.zeros(1)
    return {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
            f"p50_{name}_ms": float(np.median(arr)), f"p90_{name}_ms": float(np.percentile(arr, 90)),
            f"p99_{name}_ms": float(np.percentile(arr, 99))}


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
              ) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    result: dict[str, Any] = {
        "model": model, "base_url": args.base_url, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "structured_output_ratio": args.structured_output_ratio,
        "duration_s": duration, "completed": len(ok), "failures": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    result.update(_dist("ttft", [r.ttft for r in ok]))
    result.update(_dist("tpot", tpot))
    result.update(_dist("itl", [g for r in ok for g in r.itl]))
    result.update(_dist("e2el", [r.e2e for r in ok]))
    # A decode stall: the longest wait between two tokens of one stream (a prefill run ahead of its decode),
    # which means and percentiles over all gaps hide. One value per stream, then the worst of all.
    stalls = [max(r.itl) for r in ok if r.itl]
    result.update(_dist("stall", stalls))
    result["max_stall_ms"] = max(stalls) * 1000.0 if stalls else 0.0
    return result


def format_summary(result: dict[str, Any]) -> str:
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20,
             f"{'Successful requests:':<40}{result['completed']}",
             f"{'Failed requests:':<40}{result['failures']}",
             f"{'Benchmark duration (s):':<40}{result['duration_s']:.2f}",
             f"{'Total input tokens:':<40}{result['total_input_tokens']}",
             f"{'Total generated tokens:':<40}{result['total_output_tokens']}",
             f"{'Request throughput (req/s):':<40}{result['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<40}{result['total_token_throughput']:.2f}"]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"),
                        ("stall", "Longest Gap per Stream (decode stall)")):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}{result[f'{stat}_{name}_ms']:.2f}")
    lines.append(f"{'Max STALL (ms):':<40}{result['max_stall_ms']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="forerun bench serve", description=__doc__)
    run(add_args(parser).parse_args(argv))


if __name__ == "__main__":
    main()
