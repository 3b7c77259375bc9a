"""SamplingParams.prompt_logprobs (vLLM's): equal to transformers' log_softmax over the prompt, the same
under chunked prefill, sync and async scheduling and prefix caching, and refused where unsupported."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from forerun import LLM, SamplingParams
from tests.hf_reference import hf_prompt_logprobs
from tests.serve_helpers import serving

PROMPTS = ["The capital of France is Paris, the capital of Italy is Rome, the capital of Spain is Madrid, and the "
           "capital of Germany is",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "Hi"]
K = 3


def token_prompts(folder, prompts):
    from forerun.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    return [tok.encode(p) for p in prompts]


def run(folder, ids, params, **kw):
    kw.setdefault("dtype", "float32")
    with LLM(model=str(folder), show_progress=False, **kw) as llm:
        return llm.generate(ids, params, use_tqdm=False)


def params(k: int = K, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=k, **kw)


def check_against(ref: list[torch.Tensor], outs, k: int, atol: float) -> None:
    """Each position holds the prompt token's logprob and rank and the top k, all as transformers has them."""
    for want, out in zip(ref, outs):
        ids, got = out.prompt_token_ids, out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None and out.prompt_ranks[0] is None
        for j in range(1, len(ids)):
            row, entry, tok = want[j - 1], got[j], ids[j]
            assert entry[tok] == pytest.approx(float(row[tok]), abs=atol)
            # The rank, up to tokens within `atol` of the prompt token's logprob (near-ties may swap).
            lo, hi = (int((row > row[tok] + d).sum()) + 1 for d in (atol, -atol))
            assert lo <= out.prompt_ranks[j] <= hi
            top = row.topk(k)
            for tid, value in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[tid] == pytest.approx(value, abs=atol), (j, tid)
            assert len(entry) == k + (tok not in top.indices.tolist())


def test_tiny_model_matches_transformers(tiny_llama_dir):
    ids = token_prompts(tiny_llama_dir, PROMPTS)
    outs = run(tiny_llama_dir, ids, params())
    check_against(hf_prompt_logprobs(tiny_llama_dir, ids), outs, K, 1e-4)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)


@pytest.fixture(scope="module")
def default_offline(smollm2_dir):
    """The default model's prompt logprobs offline (float32, async scheduling), for transformers and the server."""
    ids = token_prompts(smollm2_dir, PROMPTS[:2])
    return ids, run(smollm2_dir, ids, params(2))


def test_default_model_matches_transformers(default_offline, smollm2_hf_dir):
    ids, outs = default_offline
    check_against(hf_prompt_logprobs(smollm2_hf_dir, ids), outs, 2, 5e-4)


def same(a, b) -> None:
    for x, y in zip(a, b):
        # A far-down rank may move by one when another chunking rounds a near-tie the other way.
        assert all(abs(rx - ry) <= 1 for rx, ry in zip(x.prompt_ranks[1:], y.prompt_ranks[1:]))
        assert x.prompt_ranks[0] is None and y.prompt_ranks[0] is None
        for ex, ey in zip(x.prompt_logprobs, y.prompt_logprobs):
            assert (ex is None) == (ey is None)
            if ex is not None:
                assert ex.keys() == ey.keys()
                assert all(ex[t] == pytest.approx(ey[t], abs=1e-4) for t in ex)


@pytest.mark.parametrize("async_mode", [False, True])
def test_chunked_prefill_and_prefix_cache_give_the_same(tiny_llama_dir, async_mode):
    # The first prompt again, so its second copy would be a prefix-cache hit were it not refused.
    ids = token_prompts(tiny_llama_dir, PROMPTS + PROMPTS[:1])
    base = run(tiny_llama_dir, ids, params(), async_scheduling=async_mode, enable_prefix_caching=False)
    chunked = run(tiny_llama_dir, ids, params(), async_scheduling=async_mode, max_num_batched_tokens=8,
                  enable_prefix_caching=True)
    same(base, chunked)
    same(base[:1], base[-1:])
    assert all(o.num_cached_tokens == 0 for o in chunked)


def test_mixed_batch_and_n(tiny_llama_dir):
    """Rows without prompt_logprobs get none; n > 1 reports the prompt's once; k = 0 holds the prompt token."""
    ids = token_prompts(tiny_llama_dir, PROMPTS[:2])
    outs = run(tiny_llama_dir, ids, [params(0, n=2), SamplingParams(temperature=0.0, max_tokens=2)],
               max_num_batched_tokens=8)
    assert outs[1].prompt_logprobs is None
    got = outs[0].prompt_logprobs
    assert len(outs[0].outputs) == 2 and len(got) == len(ids[0])
    assert all(list(got[j]) == [ids[0][j]] for j in range(1, len(got)))
    ref = run(tiny_llama_dir, ids[:1], params(0))
    same(ref, outs[:1])


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "2", True])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_refused_with_speculative_decoding(tiny_llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False, speculative_config=spec) as llm:
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate([[5, 6, 7]], params(), use_tqdm=False)


# ---- the server ------------------------------------------------------------------------------------
# float32 as offline; a small token budget so prompts are prefilled in chunks here too.
SERVER_ARGS = ("--served-model-name", "smol", "--max-model-len", "2048", "--dtype", "float32",
               "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def server():
    yield from serving(None, *SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def check_shape(got: list, prompt_ids: list[int], k: int) -> None:
    """vLLM's JSON: null first, then token id strings -> {logprob, rank, decoded_token} holding the prompt
    token and the top k (ranks 1 .. k)."""
    assert len(got) == len(prompt_ids) and got[0] is None
    for tok, entry in zip(prompt_ids[1:], got[1:]):
        assert str(tok) in entry and k <= len(entry) <= k + 1
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in entry.values())
        assert sorted(v["rank"] for v in entry.values())[:k] == list(range(1, k + 1))
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_completions_match_offline(client, default_offline):
    ids, outs = default_offline
    for prompt_ids, want in zip(ids, outs):
        r = client.completions.create(model="smol", prompt=prompt_ids, max_tokens=2, temperature=0.0,
                                      extra_body={"prompt_logprobs": 2})
        got = r.choices[0].model_extra["prompt_logprobs"]
        check_shape(got, prompt_ids, 2)
        for j in range(1, len(prompt_ids)):
            assert {int(t) for t in got[j]} == set(want.prompt_logprobs[j])
            for t, v in got[j].items():
                assert v["logprob"] == pytest.approx(want.prompt_logprobs[j][int(t)], abs=1e-4)
            assert got[j][str(prompt_ids[j])]["rank"] == want.prompt_ranks[j]
        assert r.choices[0].text == want.outputs[0].text


def test_chat_carries_prompt_logprobs(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi there"}],
                                       max_tokens=2, temperature=0.0, extra_body={"prompt_logprobs": 1})
    got = r.model_extra["prompt_logprobs"]
    assert len(got) == r.usage.prompt_tokens and got[0] is None
    assert all(1 <= len(e) <= 2 and any(v["rank"] == 1 for v in e.values()) for e in got[1:])
    plain = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert plain.model_extra.get("prompt_logprobs") is None


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("extra", [{"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": "many"},
                                   {"prompt_logprobs": 1.5}, {"prompt_logprobs": 1, "stream": True}])
def test_bad_values_are_400_naming_the_field(server, route, extra):
    body = {"model": "smol", "max_tokens": 1, **extra}
    body.update({"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    r = httpx.post(f"{server.base_url}/v1/{route}", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs", r.text
