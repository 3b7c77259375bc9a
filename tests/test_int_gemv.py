"""The GEMV over integer activations (`csrc/gemv_int.c`, the `activation_bits` setting, 16 and 8):
exact integer arithmetic on x rounded per block of 32, checked against a float64 reference of that
rounding over gguf's own dequantized weights; scalar and vector paths bit-equal; a row's result
independent of the other rows and of the thread count; and within the rounding's bound of the fp32
result.

Tolerances. Against the reference of the same rounding, the kernel's only error is fp32 arithmetic:
the lane's integer converted (16 bits: it may pass 2^24), the scale d * dx and each lane's product
round once, k / 64 fused adds per lane, a 4-level tree and the minimum's sums, so
|y - ref| <= (k / 32 + 17) * 2^-24 * sum |x_q w| (generous: one rounding a step). Against fp32 x @ W.T,
each x moves by at most dx / 2 (dx = max|x| / top of its block, top = 2^(bits-1) - 1), so
|y - x W^T| <= sum_i dx_i / 2 |w_i| plus that fp32 error.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from forerun.config import EngineConfig
from forerun.kernels.build import load_native_library
from forerun.kernels.kquant_gemv import FORMATS, INT_FORMATS, KQuantGemv, available_isas
from forerun.loader.model_source import cache_dir
from tests.test_kquant_gemv import _blocks, _reference


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return lib


BITS = (16, 8)


def _rounded_x(x: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(q * dx as float64 [rows, k], dx per value [rows, k]): x rounded as the kernel defines it, in
    fp32 arithmetic (amax / top, its reciprocal, x times it rounded to nearest even)."""
    top = np.float32(2 ** (bits - 1) - 1)
    xb = x.numpy().reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(-1, keepdims=True) / top
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(xb * inv), -top, top)
    dx = np.broadcast_to(d, xb.shape)
    return (q.astype(np.float64) * d).reshape(x.shape), dx.reshape(x.shape).astype(np.float64)


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    if k > 32:
        x[0, :32] = 0  # an all-zero block: dx = 0 must give zeros, not nan
    return x


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize(("rows", "n", "blocks_per_row"), [(1, 37, 1), (3, 8, 3), (6, 13, 18)])
def test_matches_the_rounded_reference_and_the_fp32_bound(lib, fmt, bits, rows, n, blocks_per_row):
    k = FORMATS[fmt].weights * blocks_per_row
    blocks = _blocks(fmt, n, k, seed=rows + n)
    x = _x(rows, k, seed=n)
    y = KQuantGemv(lib, torch.from_numpy(blocks), fmt, k, activation_bits=bits)(x).double().numpy()
    w = _reference(blocks, fmt).double().numpy()
    xq, dx = _rounded_x(x, bits)
    ref = xq @ w.T
    size = np.abs(xq) @ np.abs(w.T)
    assert np.all(np.abs(y - ref) <= (k / 32 + 17) * 2.0 ** -24 * size + 1e-30)
    exact = x.double().numpy() @ w.T
    assert np.all(np.abs(y - exact) <= (dx / 2) @ np.abs(w.T) + (k / 32 + 17) * 2.0 ** -24 * size + 1e-30)
    assert not np.array_equal(y, exact.astype(np.float32)), "x was rounded: y is not the fp32 product"


def test_sixteen_bits_are_far_closer_to_fp32_than_eight(lib):
    # What 16 bits are for: the same GEMV within about 2^-16 of fp32 x @ W.T where 8 bits are at 2^-8.
    fmt, k, n = "Q4_K", 2048, 64
    blocks = _blocks(fmt, n, k, seed=5)
    w = _reference(blocks, fmt).double().numpy()
    x = _x(1, k, seed=6)
    exact = x.double().numpy() @ w.T
    size = np.abs(x.double().numpy()) @ np.abs(w.T)
    err = {bits: np.max(np.abs(KQuantGemv(lib, torch.from_numpy(blocks), fmt, k, activation_bits=bits)(x)
                               .double().numpy() - exact) / size) for bits in BITS}
    assert err[16] < 2.0 ** -16 and err[8] > 2.0 ** -12 and err[8] > 100 * err[16], err


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize(("long_rows", "n"), [(False, 19), (False, 20), (True, 19)])
def test_paths_rows_and_threads_give_the_same_bits(lib, fmt, bits, long_rows, n):
    # One row of x over rows of at most 2048 weights takes three weight rows at a time (n = 19, 20: the
    # last one or two alone); long rows (past 2048 weights) go a weight row at a time.
    weights = FORMATS[fmt].weights
    k = (2048 // weights + 1) * weights if long_rows else weights * 5
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=3))
    x = _x(7, k, seed=4)
    paths = available_isas(lib, activation_bits=bits)
    assert paths in (["scalar"], ["scalar", "avx2"], ["scalar", "avx2", "avx512"])
    results = [KQuantGemv(lib, blocks, fmt, k, isa=isa, activation_bits=bits)(x) for isa in paths]
    for other in results[1:]:
        assert torch.equal(other, results[0])
    gemv = KQuantGemv(lib, blocks, fmt, k, activation_bits=bits)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = gemv(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, results[0])
    for r in range(x.shape[0]):  # each row alone, bit for bit
        assert torch.equal(gemv(x[r:r + 1]), results[0][r:r + 1])


def test_vector_path_is_built_here(lib):
    # Every machine of this project has AVX2: the vector path must be the one tested above. Where the
    # CPU has AVX-512 BW, DQ, VL and VNNI (the avx512_bf16 EPYC), the 512-bit path is built and tested
    # too, for both widths; the AVX2-only EPYC has no such path.
    assert "avx2" in available_isas(lib, activation_bits=16)
    flags = open("/proc/cpuinfo").read()
    wide = all(f" {flag} " in flags for flag in ("avx512bw", "avx512dq", "avx512vl", "avx512_vnni"))
    for bits in BITS:
        assert ("avx512" in available_isas(lib, activation_bits=bits)) == wide


def test_refusals_and_fallbacks(lib):
    blocks = torch.from_numpy(_blocks("Q2_K", 4, 256))
    with pytest.raises(ValueError, match="fmt: Q2_K has no GEMV over integer activations"):
        KQuantGemv(lib, blocks, "Q2_K", 256, activation_bits=16)
    # create() keeps fp32 activations for the formats the setting does not cover (a K-quant mix's parts)
    gemv = KQuantGemv.create(lib, blocks, "Q2_K", 256, activation_bits=16)
    assert gemv is not None and gemv.activation_bits == 32
    q8 = torch.from_numpy(_blocks("Q8_0", 4, 64))
    if "avx512" not in available_isas(lib, activation_bits=8):
        with pytest.raises(ValueError, match="isa: 'avx512' is not built"):
            KQuantGemv(lib, q8, "Q8_0", 64, isa="avx512", activation_bits=8)
    with pytest.raises(ValueError, match="isa: 'avx' is not one of"):
        KQuantGemv(lib, q8, "Q8_0", 64, isa="avx", activation_bits=8)
    with pytest.raises(ValueError, match="activation_bits: expected one of"):
        KQuantGemv(lib, q8, "Q8_0", 64, activation_bits=4)
    for bad in ("16", 12, True):
        with pytest.raises(ValueError, match="activation_bits: expected 32, 16, 8 or None"):
            EngineConfig(activation_bits=bad).validate()
    with pytest.raises(ValueError, match="activation_bits: batch_invariant"):
        EngineConfig(activation_bits=16, batch_invariant=True).validate()
    EngineConfig(activation_bits=32, batch_invariant=True).validate()


@pytest.mark.parametrize("bits", BITS)
def test_bf16_input_and_gguf_quantized_weights(lib, bits):
    # Weights quantized by gguf itself, the input in bf16 (converted exactly to fp32 at the kernel).
    k, n = 576, 24
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    gemv = KQuantGemv(lib, torch.from_numpy(np.ascontiguousarray(blocks)), "Q8_0", k, activation_bits=bits)
    y = gemv(x, fp32_out=True)
    assert y.dtype == torch.float32
    ref = _rounded_x(x.float(), bits)[0] @ _reference(blocks, "Q8_0").double().numpy().T
    assert np.allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4)
