"""The block probe (forerun.kernels.block_probe): batch invariance by default where the lane matmul keeps
INVARIANT_COST of the fastest batched block matmul, else the fastest; measured once and cached."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest

from forerun.kernels import block_probe
from forerun.kernels.block_probe import (BF16_BLOCKS, FP32_BLOCKS, INVARIANT_COST, LANES, BlockChoice,
                                         block_candidates, choose_block_dtype, decide)
from forerun.kernels.build import load_native_library
from forerun.loader.model_source import cache_dir

SHAPES = [(256, 96, 2), (512, 256, 1)]


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


def test_the_answer_is_measured_once_and_cached(lib, monkeypatch, tmp_path: Path) -> None:
    cache = tmp_path / "probe.json"
    if block_candidates(lib) == [LANES]:  # no AVX-512: the lane matmul is the only vector kernel
        assert choose_block_dtype(lib, SHAPES, "Q4_K", 8, cache) == BlockChoice("float32", True, {})
        assert not cache.exists()
        return
    first = choose_block_dtype(lib, SHAPES, "Q4_K", 8, cache)
    assert set(first.gflops) == set(block_candidates(lib)) and all(g > 0 for g in first.gflops.values())
    monkeypatch.setattr(block_probe, "measure_blocks", lambda *a, **k: pytest.fail("measured again"))
    assert choose_block_dtype(lib, SHAPES, "Q4_K", 8, cache) == first
    # A damaged entry costs a measurement, not the start.
    data = json.loads(cache.read_text())
    for entry in data.values():
        entry["gflops"] = "fast"
    cache.write_text(json.dumps(data))
    fake = {name: 1.0 for name in block_candidates(lib)} | {FP32_BLOCKS: 3.0}
    monkeypatch.setattr(block_probe, "measure_blocks", lambda *a, **k: fake)
    assert choose_block_dtype(lib, SHAPES, "Q4_K", 8, cache) == BlockChoice("float32", False, fake)
