"""The block probe (forerun.kernels.block_probe): batch invariance by default where the lane matmul keeps
INVARIANT_COST of the fastest batched block matmul over a decode step and a prefill chunk, else the
fastest; measured once and cached."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest

from forerun.kernels import block_probe
from forerun.kernels.block_probe import (BF16_BLOCKS, FP32_BLOCKS, INVARIANT_COST, LANES,
                                         AttentionShape, BlockChoice, Workload, attention_seconds,
                                         block_candidates, choose_block_dtype, decide, workload_gflops)
from forerun.kernels.build import load_native_library
from forerun.loader.model_source import cache_dir
from tests.conftest import judge_machine

SHAPES = [(256, 96, 2), (512, 256, 1)]
WORK = Workload(SHAPES, SHAPES[:1], 8, 32, AttentionShape(4, 2, 16, 2))


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = load_native_library(cache_dir() / "kernels")
    assert lib is not None
    return lib


@pytest.mark.parametrize("lanes, fp32, bf16, want", [
    (100, 90, 80, BlockChoice("float32", True, {})),
    (100, 100 / INVARIANT_COST - 0.5, 80, BlockChoice("float32", True, {})),
    (100, 100 / INVARIANT_COST + 0.5, 80, BlockChoice("float32", False, {})),
    (100, 90, 100 / INVARIANT_COST + 0.5, BlockChoice("bfloat16", False, {})),
])
def test_invariance_is_the_default_only_within_the_allowed_cost(lanes, fp32, bf16, want):
    got = decide({LANES: lanes, FP32_BLOCKS: fp32, BF16_BLOCKS: bf16})
    assert (got.dtype, got.invariant) == (want.dtype, want.invariant)


def test_a_workload_adds_the_decode_and_prefill_times():
    # 1 GFLOP a token at 100 GFLOPS and 3 at 300: 4 GFLOPs in 0.02 s, so 200 GFLOPS; a candidate slower
    # at decode but faster at prefill can come out ahead.
    got = workload_gflops({LANES: 100.0, FP32_BLOCKS: 110.0}, {LANES: 300.0, FP32_BLOCKS: 250.0}, 1e9, 3e9)
    assert got[LANES] == pytest.approx(200.0)
    assert got[FP32_BLOCKS] == pytest.approx(4 / (1 / 110 + 3 / 250))
    assert got[LANES] > got[FP32_BLOCKS]
    # Time every candidate spends alike narrows the gap between them.
    shared = workload_gflops({LANES: 90.0, FP32_BLOCKS: 100.0}, {LANES: 90.0, FP32_BLOCKS: 100.0}, 1e9, 1e9, 0.02)
    assert shared[LANES] == pytest.approx(2 / (2 / 90 + 0.02))
    assert shared[LANES] / shared[FP32_BLOCKS] > 0.9


def test_attention_is_timed_per_decode_token(lib) -> None:
    one = attention_seconds(lib, AttentionShape(4, 2, 16, 1), 4, context=64, rounds=2)
    assert 0 < one < 1
    # Ten layers attend ten times as long (within timing noise, best of rounds).
    assert attention_seconds(lib, AttentionShape(4, 2, 16, 10), 4, context=64, rounds=2) > 3 * one


def test_both_steps_are_timed_at_their_sizes(lib, monkeypatch, tmp_path: Path) -> None:
    seen = []

    def fake(lib, shapes, fmt, batch, candidates, rounds=5, limit=0):
        seen.append((shapes, batch))
        return {name: 100.0 if batch == WORK.prefill_rows else 50.0 for name in candidates}

    monkeypatch.setattr(block_probe, "measure_blocks", fake)
    monkeypatch.setattr(block_probe, "attention_seconds", lambda lib, shape, rows: 0.0)
    choice = choose_block_dtype(lib, WORK, "Q4_K", tmp_path / "probe.json")
    if block_candidates(lib) == [LANES]:  # no AVX2: nothing to time the lane matmul against
        assert seen == [] and choice == BlockChoice("float32", True, {})
        return
    assert sorted(seen, key=lambda s: s[1]) == [(WORK.decode, 8), (WORK.prefill, WORK.prefill_rows)]
    decode_flops, prefill_flops = 2.0 * (256 * 96 * 2 + 512 * 256), 2.0 * 256 * 96 * 2
    want = (decode_flops + prefill_flops) / (decode_flops / 50 + prefill_flops / 100)
    assert all(g == pytest.approx(want) for g in choice.gflops.values())


def test_the_fp32_block_matmul_is_timed_wherever_it_has_a_vector_path(lib) -> None:
    # On an AVX2-only CPU the lane matmul kept 0.77 of the fp32 block matmul's speed: invariance
    # there must be a measured choice, not the only one.
    flags = open("/proc/cpuinfo").read()
    if " avx2 " in flags and " fma " in flags:
        assert FP32_BLOCKS in block_candidates(lib)


def test_the_answer_is_measured_once_and_cached(lib, monkeypatch, tmp_path: Path) -> None:
    judge_machine(monkeypatch, False)  # a busy verdict would make the cached answer be measured again
    cache = tmp_path / "probe.json"
    if block_candidates(lib) == [LANES]:  # no AVX2: the lane matmul is the only vector kernel
        assert choose_block_dtype(lib, WORK, "Q4_K", cache) == BlockChoice("float32", True, {})
        assert not cache.exists()
        return
    first = choose_block_dtype(lib, WORK, "Q4_K", cache)
    assert set(first.gflops) == set(block_candidates(lib)) and all(g > 0 for g in first.gflops.values())
    monkeypatch.setattr(block_probe, "measure_blocks", lambda *a, **k: pytest.fail("measured again"))
    assert choose_block_dtype(lib, WORK, "Q4_K", cache) == first
    # A damaged entry costs a measurement, not the start.
    data = json.loads(cache.read_text())
    for entry in data.values():
        entry["gflops"] = "fast"
    cache.write_text(json.dumps(data))
    fake = {name: 1.0 for name in block_candidates(lib)} | {FP32_BLOCKS: 3.0}
    monkeypatch.setattr(block_probe, "measure_blocks", lambda *a, **k: fake)
    monkeypatch.setattr(block_probe, "attention_seconds", lambda *a, **k: 0.0)
    # The same speeds at both sizes and no shared time: the workload's GFLOPS are those speeds.
    got = choose_block_dtype(lib, WORK, "Q4_K", cache)
    assert (got.dtype, got.invariant) == ("float32", False)
    assert got.gflops == pytest.approx(fake)
