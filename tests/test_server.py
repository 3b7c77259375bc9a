"""The OpenAI-compatible server end to end: a real `forerun serve` subprocess and the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import re

import httpx
import jsonschema
import openai
import pytest

from forerun import LLM, SamplingParams
from serve_helpers import alive, descendants, serving, start_server, stop_server, wait_idle

API_KEY = "test-key"
NUM_BLOCKS = 256
GREEDY = dict(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    # The key comes from a file (with a trailing newline, as editors write it), so it is not in `ps`.
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(API_KEY + "\n")
    yield from serving(tiny_llama_dir, "--served-model-name", "tiny", "tiny-alias", "--max-model-len", "256",
                       "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", "16", api_key_file=key_file)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_health_and_completion(server, client):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    aliased = client.completions.create(model="tiny-alias", prompt="Hello, my name is", **GREEDY)
    assert aliased.model == "tiny"  # every served name reaches the same model; responses carry the first
    r = client.completions.create(model="tiny", prompt="Hello, my name is", **GREEDY)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("length", "stop") and r.choices[0].text
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_completion_matches_non_streamed(client):
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", **GREEDY)
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]


def test_chat_streaming_equals_non_streamed(client):
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, temperature=0.0, max_completion_tokens=16)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=msgs, temperature=0.0, max_completion_tokens=16,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n2_and_seed_reproducible(client):
    kw = dict(model="tiny", prompt="Once upon a time", n=2, temperature=1.0, max_tokens=10, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # each child gets its own seed
    c = client.completions.create(**{**kw, "seed": 99})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          temperature=1.0, max_tokens=6, seed=5)
    assert sorted(ch.index for ch in chat.choices) == [0, 1]


def test_streaming_n2_each_choice_finishes_once(client):
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", n=2, temperature=1.0,
                                            max_tokens=10, seed=7, stream=True))
    whole = client.completions.create(model="tiny", prompt="Once upon a time", n=2, temperature=1.0,
                                      max_tokens=10, seed=7)
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(ch.text for ch in mine) == whole.choices[i].text
        assert sum(ch.finish_reason is not None for ch in mine) == 1


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Hello", logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and tok_lp <= 0.0
        assert tok_lp == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=2, temperature=0.0, max_tokens=5)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
               for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_stop_string(client):
    base = client.completions.create(model="tiny", prompt="Hello, my name is", temperature=0.0, max_tokens=16,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    assert stop.strip(), base
    r = client.completions.create(model="tiny", prompt="Hello, my name is", temperature=0.0, max_tokens=16,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]


def test_ignore_eos_and_min_tokens_extra_fields(client, tiny_llama_dir):
    prompt = [1, 504, 3458, 314, 260, 3575]  # token ids: the same prompt here and in the server
    with LLM(model=str(tiny_llama_dir), show_progress=False) as llm:  # the server's model, for token ids
        ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(3, len(ref)) if ref.index(ref[i]) == i)
    body = dict(model="tiny", prompt=prompt, temperature=0.0, max_tokens=20)

    def completion_tokens(**extra) -> tuple[int, str]:
        r = client.completions.create(**body, extra_body={"ignore_eos": True, "stop_token_ids": [ref[k]], **extra})
        return r.usage.completion_tokens, r.choices[0].finish_reason

    assert completion_tokens() == (k + 1, "stop")  # stops where the id first comes
    assert completion_tokens(min_tokens=k) == (k + 1, "stop")  # the (k+1)-th token may be the stop id
    n, reason = completion_tokens(min_tokens=k + 1)  # now held back there, so it runs on
    assert n >= k + 2 and reason in ("stop", "length")


def test_response_format_json_schema(client):
    # The core process once handed EngineCore a grammar manager where it expects a factory, so every
    # structured request through the server was refused.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                       temperature=0.0, max_tokens=40,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "answer", "schema": schema}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text)["ok"], bool)


CHOICES = ["yes", "no", "maybe later"]
REGEX = r"[0-9]{3}-[a-z]{2}"
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False}
STRUCTURED_MODES = [("choice", CHOICES), ("regex", REGEX), ("grammar", 'root ::= "red" | "green" | "blue"'),
                    ("json", SMALL_SCHEMA), ("json_object", True)]


def check_structured(mode: str, text: str, finish: str) -> None:
    assert finish in ("stop", "length"), (mode, text, finish)
    if mode == "choice":
        assert finish == "stop" and text in CHOICES, text
    elif mode == "regex":
        assert finish == "stop" and re.fullmatch(REGEX, text), text
    elif mode == "grammar":
        assert finish == "stop" and text in ("red", "green", "blue"), text
    elif finish == "stop":  # a JSON value may run past max_tokens inside a string; when it ends, it conforms
        value = json.loads(text)
        if mode == "json":
            jsonschema.validate(value, SMALL_SCHEMA)
        else:
            assert isinstance(value, dict)
    else:
        assert text.lstrip().startswith("{"), text


@pytest.mark.parametrize("mode,spec", STRUCTURED_MODES, ids=[m for m, _ in STRUCTURED_MODES])
def test_structured_outputs_field_on_both_endpoints(client, mode, spec):
    # vLLM's `structured_outputs` body field was accepted and ignored: `choice: [yes, no]` gave free text.
    extra = {"structured_outputs": {mode: spec}}
    for seed in (0, 1):  # sampled, so the model's own preference is not what makes the output conform
        r = client.completions.create(model="tiny", prompt="Answer:", temperature=1.0, seed=seed, max_tokens=24,
                                      extra_body=extra)
        check_structured(mode, r.choices[0].text, r.choices[0].finish_reason)
        c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer me"}],
                                           temperature=1.0, seed=seed, max_tokens=24, extra_body=extra)
        check_structured(mode, c.choices[0].message.content, c.choices[0].finish_reason)


CHAT_REFUSALS = [
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    # tool_choice "auto" is the default with tools, and needs --enable-auto-tool-choice (as in vLLM).
    ("tools without auto tool choice", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tool_choice"),
    ("tool_choice auto", {"tool_choice": "auto"}, "tool_choice"),
    ("functions", {"functions": [{"name": "f"}]}, "functions"),
    ("function_call", {"function_call": {"name": "f"}}, "function_call"),
    ("parallel_tool_calls not a bool", {"parallel_tool_calls": "sometimes"}, "parallel_tool_calls"),
    ("tool_calls in a user message", {"messages": [{"role": "user", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ("unknown field", {"frobnicate": 1}, "frobnicate"),
    ("guided_choice (vLLM's old name)", {"guided_choice": ["a"]}, "guided_choice"),
    ("vLLM option forerun lacks", {"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("two structured modes", {"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ("both structured fields", {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
]


@pytest.mark.parametrize("name,extra,param", CHAT_REFUSALS, ids=[c[0] for c in CHAT_REFUSALS])
def test_unsupported_chat_fields_are_400_naming_the_field(server, name, extra, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err


def test_tool_choice_none_and_every_role_accepted(server):
    messages = [{"role": r, "content": "hi"} for r in ("system", "developer", "user")]
    for extra in ({"tool_choice": "none"}, {"function_call": "none"}):
        body = {"model": "tiny", "messages": messages, "max_tokens": 2, **extra}
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
        assert r.status_code == 200, r.text
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}]}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code in (200, 400), r.text  # the template decides what it renders; never a 5xx
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "messages"


def test_unknown_model_404_lists_the_served_names(server):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "SmolLM2", "prompt": "hi"},
                   headers=server.headers)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert "`tiny`" in err["message"] and "`tiny-alias`" in err["message"], err


BAD_REQUESTS = [
    ("wrong type", {"prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens"),
    ("max_tokens < 1", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature < 0", {"prompt": "hi", "temperature": -1.0}, 400, "temperature"),
    ("prompt too long", {"prompt": "hello " * 400, "max_tokens": 4}, 400, "prompt"),
    # 100 prompt tokens leave 156 of max_model_len 256: one more is refused, not silently capped.
    ("max_tokens past the context", {"prompt": [5] * 100, "max_tokens": 157}, 400, "max_tokens"),
    ("stop id outside vocab", {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [1000000]}, 400, "stop_token_ids"),
    ("prompt id outside vocab", {"prompt": [1, 2, 1000000], "max_tokens": 4}, 400, "prompt"),
    ("seed past 64 bits", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("unknown model", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    ("missing prompt", {"max_tokens": 4}, 400, "prompt"),
    # Found by the fuzz test: n had no bound (n = 2**64 hung the server building children) and a huge
    # top_k overflowed the worker's int64 tensor, failing the whole step.
    ("n past 128", {"prompt": "hi", "n": 2**64}, 400, "n"),
    ("top_k past 2**31", {"prompt": "hi", "top_k": 10**30}, 400, "top_k"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_then_good_one(server, client, name, body, status, param):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", **body}, headers=server.headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


def test_max_tokens_that_just_fits_runs_to_the_context(server):
    body = {"model": "tiny", "prompt": [5] * 100, "max_tokens": 156, "ignore_eos": True, "temperature": 0.0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 156


@pytest.mark.parametrize("kwargs,param", [({"add_generation_prompt": "x"}, "chat_template_kwargs"),
                                          ({"messages": 1}, "chat_template_kwargs"),
                                          ({"tools": 5}, "chat_template_kwargs")])
def test_chat_template_kwargs_refused_with_400(server, client, kwargs, param):
    # These reached the template as clashing or wrongly typed arguments: a TypeError, answered with 500.
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=server.headers,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                         "chat_template_kwargs": kwargs})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content is not None


def test_priority_refused_under_fcfs(server):
    r = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                   json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "priority": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    ok = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                    json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "priority": 0})
    assert ok.status_code == 200, ok.text


def test_invalid_json_wrong_key_and_openai_client_errors(server, client):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    with pytest.raises(openai.BadRequestError):  # bad streamed request: a plain 400, not a broken stream
        list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 300}],
                                            stream=True))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content is not None


def test_disconnect_mid_stream_frees_blocks(server):
    before = wait_idle(server)["forerun:generation_tokens_total"]
    body = {"model": "tiny", "prompt": "Count: " + "1 2 3 " * 10, "max_tokens": 150, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers,
                      timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
        during = server.metrics()
    assert during["forerun:num_requests_running"] == 1 and during["forerun:kv_cache_blocks_used"] > 0
    after = wait_idle(server)
    assert after["forerun:num_requests_running"] == 0
    assert after["forerun:kv_cache_blocks_used"] == 0 and after["forerun:kv_cache_blocks_free"] == NUM_BLOCKS
    assert after["forerun:generation_tokens_total"] - before < 150  # aborted, not run to the end


def test_64_concurrent_streams(server):
    async def main() -> list[tuple[int, int, str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i: int) -> tuple[int, int, str]:
            stream = await aclient.completions.create(model="tiny", prompt=f"Request number {i}:", max_tokens=8,
                                                      temperature=0.8, seed=i, stream=True,
                                                      stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
            pieces, usage, finish = 0, 0, ""
            async for chunk in stream:
                if chunk.choices:
                    pieces += 1
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return pieces, usage, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(usage == 8 and finish == "length" and pieces >= 1 for pieces, usage, finish in results), results
    m = wait_idle(server)
    assert m["forerun:num_requests_running"] == 0 and m["forerun:num_requests_waiting"] == 0
    assert m["forerun:kv_cache_blocks_free"] == NUM_BLOCKS and m["forerun:kv_cache_blocks_used"] == 0
    assert m["forerun:time_to_first_token_seconds_count"] >= 64
    assert m["forerun:generation_tokens_total"] >= 64 * 8


def test_sigterm_with_stream_in_flight_exits_cleanly(server):
    kids = descendants(server.proc.pid)
    assert kids, "the engine core runs in a child process"
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 240, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers,
                      timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    server.proc.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "server is shutting down"  # aborted, not finished
    code, left = stop_server(server)
    assert code in (0, -signal.SIGTERM), server.log()
    assert not left and not any(alive(k) for k in kids)


def test_real_model_paris_then_engine_death_gives_503(smollm2_dir):
    srv = start_server(None, "--max-model-len", "512", "--num-kv-blocks", "64")
    try:
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        # A short id, not the cache folder's `SmolLM2-135M-Instruct.Q4_1-<hash>`; the longer names still work.
        assert model == "SmolLM2-135M-Instruct", model
        for alias in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(smollm2_dir.name), str(smollm2_dir)):
            assert c.completions.create(model=alias, prompt="Hi", max_tokens=1).model == model
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      temperature=0.0, max_tokens=16)
        assert "Paris" in r.choices[0].message.content
        core = [k for k in descendants(srv.proc.pid) if "forerun-engine" in _cmdline(k) or _is_spawned_core(k)]
        assert core
        for pid in core:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{srv.base_url}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        health = httpx.get(f"{srv.base_url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_down"
        with pytest.raises(openai.APIStatusError) as info:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert info.value.status_code == 503
        # Then it exits on its own, non-zero, so a supervisor restarts it.
        assert srv.proc.wait(timeout=30) == 1, srv.log()
    finally:
        code, left = stop_server(srv)
    assert not left


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_spawned_core(pid: int) -> bool:
    # The core runs `python -c "...from forerun.executor.spawn import run_child..."` (PythonChild).
    return "run_child" in _cmdline(pid)
