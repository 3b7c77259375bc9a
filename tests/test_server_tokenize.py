"""vLLM's serving extras on the default model: /tokenize and /detokenize against transformers' tokenizer,
`echo`, `return_tokens_as_token_ids`, and vLLM's metric names."""

from __future__ import annotations

import httpx
import openai
import pytest

from serve_helpers import serving

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! Où est Paris?"}]


@pytest.fixture(scope="module")
def server():
    yield from serving(None, "--served-model-name", "smol", "--max-model-len", "512")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def hf_chat_ids(hf_tokenizer, add_generation_prompt: bool) -> list[int]:
    return list(hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 return_dict=False))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_tokenize_prompt_and_messages_match_transformers(server, hf_tokenizer):
    r = post(server, "/tokenize", {"model": "smol", "prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == hf_tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["token_strs"] == hf_tokenizer.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] == 512
    chat = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == hf_chat_ids(hf_tokenizer, add_generation_prompt=True)
    plain = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert plain["tokens"] == hf_chat_ids(hf_tokenizer, add_generation_prompt=False)


def test_tokenize_counts_what_chat_completions_sends(server, client):
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    counted = post(server, "/tokenize", {"messages": MESSAGES, "tools": tools}).json()["count"]
    r = client.chat.completions.create(model="smol", messages=MESSAGES, tools=tools, tool_choice="required",
                                       max_tokens=16, temperature=0.0)
    assert r.usage.prompt_tokens == counted


def test_detokenize_matches_transformers(server, hf_tokenizer):
    ids = hf_chat_ids(hf_tokenizer, add_generation_prompt=True)
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == hf_tokenizer.decode(ids)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "maybe"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_requests_are_400(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_puts_the_prompt_before_the_completion(server, client, hf_tokenizer):
    kw = dict(model="smol", temperature=0.0, max_tokens=8)
    plain = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kw).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPT, echo=True, stream=True, **kw)
                       if c.choices)
    assert streamed == echoed
    ids = hf_tokenizer.encode(PROMPT)
    by_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert by_ids == hf_tokenizer.decode(ids) + plain
    r = post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_return_tokens_as_token_ids(server, client, hf_tokenizer):
    r = client.completions.create(model="smol", prompt=PROMPT, temperature=0.0, max_tokens=6, logprobs=2,
                                  extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in r.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in r.logprobs.tokens) and hf_tokenizer.decode(ids) == r.text
    assert all(all(k.startswith("token_id:") for k in top) for top in r.logprobs.top_logprobs)
    c = client.chat.completions.create(model="smol", messages=MESSAGES, temperature=0.0, max_tokens=6, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    chat_ids = [int(t.token.removeprefix("token_id:")) for t in c.logprobs.content]
    assert hf_tokenizer.decode(chat_ids, skip_special_tokens=True) == c.message.content


def test_vllm_metric_names(server, client):
    client.completions.create(model="smol", prompt=PROMPT, temperature=0.0, max_tokens=4)
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_count"):
        assert name in m, name
    assert m["vllm:prompt_tokens_total"] == m["forerun:prompt_tokens_total"] > 0
    assert m["vllm:request_success_total"] == m["forerun:request_success_total"] >= 1
    assert m["vllm:time_to_first_token_seconds_count"] == m["forerun:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:e2e_request_latency_seconds_count"] == m["vllm:request_prompt_tokens_count"] >= 1
    assert m["vllm:generation_tokens_total"] == m["forerun:generation_tokens_total"]
