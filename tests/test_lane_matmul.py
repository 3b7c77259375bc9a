"""The lane matmul (`csrc/gemm_lanes.c`): the block GEMV's sums at many rows, bit for bit.

Batch invariance at no cost to one user rests on one claim: a row's result from this kernel, at any
row count, path or thread count, is exactly the block GEMV's result for that row alone. These tests
check that claim in every format on shapes that exercise the kernel's edges (short register blocks,
partial spans of columns, rows past one chunk), and its accuracy against gguf's dequantizer.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from forerun.kernels.block_linear import large_block_linear
from forerun.kernels.build import load_native_library
from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.kquant_gemv import FORMATS, KQuantGemv
from forerun.kernels.lane_matmul import LaneMatmul, available_isas
from forerun.loader.model_source import cache_dir
from test_kquant_gemv import _blocks, _reference

SHAPES = {"Q4_0": (96, 53), "Q4_1": (64, 97), "Q5_0": (160, 50), "Q5_1": (32, 49), "Q8_0": (128, 101),
          "IQ4_NL": (64, 48), "Q2_K": (256, 47), "Q3_K": (512, 50), "Q4_K": (256, 99), "Q5_K": (256, 96),
          "Q6_K": (512, 45), "IQ4_XS": (256, 52)}


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return lib


def _alone(gemv: KQuantGemv, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([gemv(x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_row_equals_the_gemv_on_that_row_alone(lib, fmt):
    k, n = SHAPES[fmt]
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=3, zeros=True))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))  # past one chunk of 64, 70 % 4 = 2
    want = _alone(KQuantGemv(lib, blocks, fmt, k), x)
    for isa in available_isas(lib):
        got = LaneMatmul(lib, blocks, fmt, k, isa)(x)
        assert torch.equal(got, want), f"{fmt} {isa}: largest difference {(got - want).abs().max()}"


@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K"])
def test_results_do_not_depend_on_the_rows_or_threads(lib, fmt):
    k, n = SHAPES[fmt]
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=5))
    mm = LaneMatmul(lib, blocks, fmt, k)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(6))
    full = mm(x)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for lo, hi in ((0, 1), (5, 8), (3, 23), (22, 23)):
                assert torch.equal(mm(x[lo:hi]), full[lo:hi]), f"{threads} threads, rows {lo}..{hi}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "IQ4_XS"])
def test_matches_the_dequantized_reference(lib, fmt):
    """Within the bound of 16-lane fp32 summation (see test_kquant_gemv) of float64 over gguf's weights."""
    k, n = SHAPES[fmt]
    raw = _blocks(fmt, n, k, seed=7)
    w = _reference(raw, fmt).double()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(8))
    got = LaneMatmul(lib, torch.from_numpy(raw), fmt, k)(x).double()
    exact = x.double() @ w.T
    bound = (k / 16 + 4) * 2.0 ** -24 * (x.double().abs() @ w.abs().T)
    assert ((got - exact).abs() <= bound).all()


def test_bf16_inputs_are_widened_and_the_result_rounded_once(lib):
    k, n = SHAPES["Q4_K"]
    blocks = torch.from_numpy(_blocks("Q4_K", n, k, seed=9))
    mm = LaneMatmul(lib, blocks, "Q4_K", k)
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    fp32 = mm(x.float())
    assert mm(x).dtype == torch.bfloat16 and torch.equal(mm(x), fp32.to(torch.bfloat16))
    assert mm(x, fp32_out=True).dtype == torch.float32 and torch.equal(mm(x, fp32_out=True), fp32)
    assert mm(x).shape == (2, 5, n)


def test_batch_invariant_mode_runs_it_for_many_fp32_rows(lib):
    """large_block_linear in the GEMV's order, batch-invariant mode's batched GGUF matmul, is this kernel:
    a batch's rows are the GEMV's bits, which is what lets the mode keep the GEMV at one row."""
    k, n = SHAPES["Q5_K"]
    raw = _blocks("Q5_K", n, k, seed=11)
    weight = CompactWeight("Q5_K", torch.from_numpy(raw), k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(12))
    got = large_block_linear(lib, weight, torch.float32, gemv_order=True)(x)
    assert torch.equal(got, _alone(KQuantGemv(lib, weight.data, "Q5_K", k), x))


def test_refusals(lib):
    blocks = torch.from_numpy(_blocks("Q4_0", 8, 64))
    with pytest.raises(ValueError, match="k"):
        LaneMatmul(lib, blocks, "Q4_0", 48)
    with pytest.raises(ValueError, match="fmt"):
        LaneMatmul(lib, blocks, "Q7_0", 64)
    with pytest.raises(ValueError, match="isa"):
        LaneMatmul(lib, blocks, "Q4_0", 64, isa="neon")
    mm = LaneMatmul(lib, blocks, "Q4_0", 64)
    with pytest.raises(ValueError, match="x"):
        mm(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="x"):
        mm(torch.zeros(2, 64, dtype=torch.float16))
    assert LaneMatmul.create(None, blocks, "Q4_0", 64) is None
    with pytest.raises(RuntimeError):
        LaneMatmul(None, blocks, "Q4_0", 64)
