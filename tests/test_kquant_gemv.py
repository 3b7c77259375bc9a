"""The GGUF-block GEMV (`csrc/gemv_kquant.c`): against gguf's own dequantizer, bit-identical results
whatever the number of rows or threads, and bit-equal scalar, AVX2 and AVX-512 paths.

Tolerance: every weight the kernel expands is bit-equal to gguf's fp32 weight, so the only error is
the fp32 summation. Each output sums k / 16 fused multiply-adds per lane and then 16 lanes in a
4-level tree, so |y - exact| <= (k / 16 + 4) * 2^-24 * sum_k |x w| (the standard bound for
recursive summation, one rounding per step); the tests assert that bound against float64.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from forerun.kernels.build import load_native_library
from forerun.kernels.kquant_gemv import FORMATS, KQuantGemv, available_isas, dequantize_blocks, supports
from forerun.loader.model_source import cache_dir

# Byte offsets of each block's fp16 fields (ggml-common.h): random bytes there could be inf or nan.
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
ROWS = [1, 2, 3, 7, 16]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return lib


def _blocks(fmt: str, n: int, k: int, seed: int = 0, zeros: bool = False) -> np.ndarray:
    """n rows of random valid blocks: random bytes, with finite random fp16 scales; with `zeros`, each
    fp16 field is +0 in one block out of 5 and -0 in another, so weights of either zero sign occur."""
    rng = np.random.default_rng(seed)
    spec = FORMATS[fmt]
    count = n * (k // spec.weights)
    blocks = rng.integers(0, 256, size=(count, spec.bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[fmt]:
        scales = (rng.uniform(-1, 1, count) * 2.0 ** rng.integers(-12, 2, count)).astype(np.float16)
        if zeros:
            pick = rng.integers(0, 5, count)
            scales[pick == 0], scales[pick == 1] = np.float16(0.0), np.float16(-0.0)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(count, 2)
    return blocks.reshape(n, -1)


def _reference(blocks: np.ndarray, fmt: str) -> torch.Tensor:
    """gguf's fp32 de-quantization of the blocks, [n, k] (the tests' pure-torch reference path)."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[fmt]))


def _x(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


def _assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    bound = (x.shape[1] / 16 + 4) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst error / bound = {float((err / bound.clamp_min(1e-300)).max())}"


def test_formats_match_gguf_block_sizes():
    assert set(FORMATS) == set(HALF_FIELDS)
    for fmt, spec in FORMATS.items():
        qtype = gguf.GGMLQuantizationType[fmt]
        assert spec.code == int(qtype)
        assert (spec.weights, spec.bytes) == gguf.GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_expanded_weights_are_gguf_weights_bit_for_bit(lib, fmt):
    """x = one-hot rows picks single weights out: y = W^T exactly when each weight is gguf's fp32 weight.
    The 32-weight formats take 18 blocks a row: the AVX-512 path reads their scales 16 blocks at a time."""
    k, n = FORMATS[fmt].weights * (2 if FORMATS[fmt].weights == 256 else 18), 5
    blocks = _blocks(fmt, n, k, seed=3)
    for isa in available_isas(lib):
        y = KQuantGemv(lib, torch.from_numpy(blocks), fmt, k, isa)(torch.eye(k))
        assert torch.equal(y.T, _reference(blocks, fmt)), isa


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(("n", "blocks_per_row"), [(1, 1), (6, 3), (37, 2)])
def test_matches_the_dequantized_reference(lib, fmt, n, blocks_per_row):
    k = FORMATS[fmt].weights * blocks_per_row
    blocks = _blocks(fmt, n, k, seed=n)
    w = _reference(blocks, fmt)
    gemv = KQuantGemv(lib, torch.from_numpy(blocks), fmt, k)
    for rows in ROWS:
        x = _x(rows, k, seed=rows)
        y = gemv(x)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        _assert_within_bound(y, x, w)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_results_do_not_depend_on_row_count_threads_or_path(lib, fmt):
    # 37 blocks of 32: two whole sets of 16 scales and a part set (the AVX-512 path reads 16 at a time)
    k, n = 2 * FORMATS[fmt].weights if FORMATS[fmt].weights == 256 else 32 * 37, 21
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=7))
    x = _x(16, k)
    isas = available_isas(lib)
    assert "scalar" in isas
    base = KQuantGemv(lib, blocks, fmt, k, "scalar")(x)
    for isa in ["auto", *isas]:
        gemv = KQuantGemv(lib, blocks, fmt, k, isa)
        y16 = gemv(x)
        assert torch.equal(y16, base), f"{isa} path differs from the scalar path"
        for i in range(16):  # each row alone gives its row of the 16-row result, bit for bit
            assert torch.equal(gemv(x[i:i + 1])[0], y16[i]), f"{isa} row {i}"
        for lo, hi in [(0, 2), (3, 6), (5, 12), (9, 16)]:
            assert torch.equal(gemv(x[lo:hi]), y16[lo:hi]), f"{isa} rows {lo}:{hi}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = KQuantGemv(lib, blocks, fmt, k)(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, base)


def test_vector_paths_are_exercised_here(lib):
    """The project's machines have AVX2 at least; a build without it would test the scalar path only."""
    assert "avx2" in available_isas(lib)


def test_bf16_input_and_leading_dimensions(lib):
    k, n = 512, 9
    blocks = torch.from_numpy(_blocks("Q4_K", n, k))
    gemv = KQuantGemv(lib, blocks, "Q4_K", k)
    x = _x(6, k).to(torch.bfloat16)
    y = gemv(x.view(2, 3, k))
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    assert torch.equal(y.view(6, n), gemv(x.float()).to(torch.bfloat16))


def test_supports_and_refusals(lib):
    assert supports("Q4_K", 512) and supports("Q8_0", 96)
    assert supports("Q4_0", 64) and supports("IQ4_XS", 256)
    assert not supports("Q4_K", 96) and not supports("IQ2_XXS", 256) and not supports("F16", 256)
    assert not supports("Q6_K", 0) and not supports("IQ4_NL", 48)
    blocks = torch.from_numpy(_blocks("Q6_K", 4, 256))
    assert KQuantGemv.create(None, blocks, "Q6_K", 256) is None
    assert KQuantGemv.create(lib, blocks, "Q6_K", 100) is None
    assert KQuantGemv.create(lib, blocks, "Q6_K", 256) is not None
    with pytest.raises(RuntimeError, match="not built"):
        KQuantGemv(None, blocks, "Q6_K", 256)
    with pytest.raises(ValueError, match="fmt"):
        KQuantGemv(lib, blocks, "IQ2_XXS", 256)
    with pytest.raises(ValueError, match="k:"):
        KQuantGemv(lib, blocks, "Q6_K", 200)
    with pytest.raises(ValueError, match="blocks"):
        KQuantGemv(lib, blocks[:, :100], "Q6_K", 256)
    with pytest.raises(ValueError, match="blocks"):
        KQuantGemv(lib, blocks.to(torch.int16), "Q6_K", 256)
    with pytest.raises(ValueError, match="isa"):
        KQuantGemv(lib, blocks, "Q6_K", 256, "neon")
    gemv = KQuantGemv(lib, blocks, "Q6_K", 256)
    with pytest.raises(ValueError, match="x:"):
        gemv(torch.zeros(1, 128))
    with pytest.raises(ValueError, match="x:"):
        gemv(torch.zeros(1, 256, dtype=torch.float64))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_blocks_is_gguf_bit_for_bit(lib, fmt):
    """Every value, down to the sign of a zero, is gguf's (compared as int32 bit patterns)."""
    k = FORMATS[fmt].weights * 3
    zeros = []
    for n, seed in [(1, 4), (13, 5), (40, 6)]:
        blocks = _blocks(fmt, n, k, seed=seed, zeros=True)
        got = dequantize_blocks(lib, torch.from_numpy(blocks), fmt, k)
        ref = _reference(blocks, fmt)
        assert got.shape == (n, k) and got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
        zeros.append(ref[ref == 0])
    signs = torch.signbit(torch.cat(zeros))
    assert bool(signs.any()) and not bool(signs.all())  # both zeros were exercised


def test_dequantize_blocks_refusals(lib):
    blocks = torch.from_numpy(_blocks("Q4_0", 3, 64))
    assert torch.equal(dequantize_blocks(lib, blocks[:0], "Q4_0", 64), torch.empty(0, 64))
    with pytest.raises(RuntimeError, match="not built"):
        dequantize_blocks(None, blocks, "Q4_0", 64)
    with pytest.raises(ValueError, match="fmt"):
        dequantize_blocks(lib, blocks, "F16", 64)
    with pytest.raises(ValueError, match="k:"):
        dequantize_blocks(lib, blocks, "Q4_0", 48)
    with pytest.raises(ValueError, match="blocks"):
        dequantize_blocks(lib, blocks, "Q4_0", 96)
    with pytest.raises(ValueError, match="blocks"):
        dequantize_blocks(lib, blocks.view(torch.int8), "Q4_0", 64)
