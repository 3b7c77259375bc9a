"""The block GEMM (`csrc/gemm_blocks.c`): against torch matmuls over gguf's dequantized weights, results
bit-identical whatever the number of rows or threads, bit-equal fp32 paths.

Tolerances. fp32: every weight is gguf's fp32 weight and each output is one chain of k fused
multiply-adds, so |y - exact| <= (k + 1) 2^-24 sum_k |x w| (recursive summation, one rounding a step).
bf16: the products of bf16 values are exact in fp32 and summed in fp32 (vdpbf16ps adds a pair a step,
with at most two roundings), so before the final rounding to bf16 the same kind of bound holds, with
the weights rounded to bf16; the bf16 result adds half an ulp of bf16 (2^-8 relative: bf16 keeps 8
significant bits), and torch's own bf16 matmul as much again.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from forerun.kernels.block_matmul import ISAS, MODE_BF16, MODE_F32, BlockMatmul, OrderedGemv, available_isas
from forerun.kernels.build import load_native_library
from forerun.kernels.kquant_gemv import FORMATS
from forerun.loader.model_source import cache_dir
from test_kquant_gemv import _blocks, _reference

ROWS = [1, 7, 64, 200]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return lib


def _k(fmt: str) -> int:
    """A k of several blocks, not a power of two for the 32-weight formats."""
    return 288 if FORMATS[fmt].weights == 32 else 512


def _x(rows: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fp32_out(lib: ctypes.CDLL, blocks: torch.Tensor, fmt: str, x: torch.Tensor, isa: str = "auto") -> torch.Tensor:
    """The kernel's fp32 result before BlockMatmul rounds it to x's dtype (for the bf16 variant)."""
    k, n = x.shape[1], blocks.shape[0]
    y = torch.empty(x.shape[0], n)
    mode = MODE_BF16 if x.dtype == torch.bfloat16 else MODE_F32
    rc = lib.gemm_blocks_f32(x.data_ptr(), mode, blocks.data_ptr(), blocks.shape[1],
                             FORMATS[fmt].code, y.data_ptr(), x.shape[0], k, n, ISAS[isa], torch.get_num_threads())
    assert rc == 0
    return y


def _assert_within(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, relative: float = 0.0) -> None:
    """|y - x w^T| <= (k + 1) 2^-24 |x| |w|^T + relative |x w^T|, computed in float64; where `relative`
    stands for a final rounding, the first term grows by as much (the rounding of the sum's error)."""
    exact = x.double() @ w.double().T
    sums = (x.shape[1] + 1) * 2.0 ** -24 * (1 + relative) * (x.double().abs() @ w.double().abs().T)
    bound = sums + relative * exact.abs()
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst error / bound = {float((err / bound.clamp_min(1e-300)).max())}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp32_matches_the_dequantized_reference(lib, fmt):
    k, n = _k(fmt), 37
    blocks = _blocks(fmt, n, k, seed=2)
    w = _reference(blocks, fmt)
    for isa in available_isas(lib, torch.float32):
        mm = BlockMatmul(lib, torch.from_numpy(blocks), fmt, k, isa)
        for rows in ROWS:
            x = _x(rows, k, torch.float32, seed=rows)
            y = mm(x)
            assert y.shape == (rows, n) and y.dtype == torch.float32
            _assert_within(y, x, w)
            assert torch.allclose(y, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4 * float(y.abs().max()))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bf16_matches_a_bf16_matmul_over_rounded_weights(lib, fmt):
    k, n = _k(fmt), 37
    blocks_np = _blocks(fmt, n, k, seed=3)
    blocks = torch.from_numpy(blocks_np)
    w16 = _reference(blocks_np, fmt).to(torch.bfloat16)  # round to nearest even, as the kernel does
    for isa in available_isas(lib, torch.bfloat16):
        mm = BlockMatmul(lib, blocks, fmt, k, isa)
        for rows in ROWS:
            x = _x(rows, k, torch.bfloat16, seed=rows)
            y = mm(x)
            assert y.shape == (rows, n) and y.dtype == torch.bfloat16
            # Before the final rounding: fp32 sums of exact products of the bf16 values; the kernel rounds
            # them once, as torch does.
            y32 = _fp32_out(lib, blocks, fmt, x, isa)
            _assert_within(y32, x.float(), w16.float())
            assert torch.equal(y.view(torch.int16), y32.to(torch.bfloat16).view(torch.int16))
            _assert_within(y.float(), x.float(), w16.float(), relative=2.0 ** -8)
            # torch's bf16 matmul over the same bf16 weights: within the two results' bounds of each other.
            torch_y = torch.nn.functional.linear(x, w16).double()
            exact = x.double() @ w16.double().T
            sums = (k + 1) * 2.0 ** -24 * (x.double().abs() @ w16.double().abs().T)
            assert bool(((y.double() - torch_y).abs() <= 2 * (sums + 2.0 ** -8 * (exact.abs() + sums))).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_weights_are_gguf_weights_exact_or_rounded_to_bf16(lib, fmt):
    """One-hot rows of x pick single weights out exactly (1 w + 0 w' = w): the fp32 variant multiplies
    by gguf's fp32 weights and the bf16 variant by those rounded to nearest even, bit for bit."""
    k, n = FORMATS[fmt].weights * 2, 7
    blocks_np = _blocks(fmt, n, k, seed=10)
    blocks, w = torch.from_numpy(blocks_np), _reference(blocks_np, fmt)
    eye = torch.eye(k)
    for isa in available_isas(lib, torch.float32):
        assert torch.equal(_fp32_out(lib, blocks, fmt, eye, isa).T, w), isa
    for isa in available_isas(lib, torch.bfloat16):
        y = _fp32_out(lib, blocks, fmt, eye.to(torch.bfloat16), isa)
        assert torch.equal(y.T, w.to(torch.bfloat16).float()), isa


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q4_K", "Q6_K", "IQ4_XS"])
def test_a_row_does_not_depend_on_the_rows_with_it(lib, fmt, dtype):
    k, n = _k(fmt), 29
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=4))
    x = _x(64, k, dtype)
    for isa in available_isas(lib, dtype):
        mm = BlockMatmul(lib, blocks, fmt, k, isa)
        y64 = mm(x)
        for i in range(64):  # each row alone gives its row of the 64-row result, bit for bit
            assert torch.equal(mm(x[i:i + 1])[0], y64[i]), f"{isa} row {i}"
        for lo, hi in [(0, 2), (3, 20), (5, 37), (17, 64), (40, 41)]:
            assert torch.equal(mm(x[lo:hi]), y64[lo:hi]), f"{isa} rows {lo}:{hi}"
        assert torch.equal(mm(torch.cat([x, x[:3]]))[:64], y64), f"{isa}: 67 rows"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q3_K", "Q5_K", "IQ4_XS"])
def test_results_do_not_depend_on_the_thread_count(lib, fmt, dtype):
    k, n = _k(fmt), 140  # several tiles and a ragged last one per thread
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=5))
    x = _x(37, k, dtype)
    mm = BlockMatmul(lib, blocks, fmt, k)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append(mm(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp32_paths_are_bit_equal(lib, fmt):
    k, n = _k(fmt), 23
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=6))
    x = _x(40, k, torch.float32)
    results = [BlockMatmul(lib, blocks, fmt, k, isa)(x) for isa in ["auto", *available_isas(lib, torch.float32)]]
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_vector_paths_are_exercised_here(lib):
    """Every vector path this CPU can run is built, and so tested above: AVX2 on both of the project's
    machine kinds, AVX-512 and AVX512_BF16 on the avx512_bf16 EPYC; elsewhere the portable paths."""
    flags = open("/proc/cpuinfo").read()
    if " avx2 " in flags and " fma " in flags:
        assert "avx2" in available_isas(lib, torch.float32)
    if " avx512f " in flags:
        assert "avx512" in available_isas(lib, torch.float32)
    if " avx512_bf16 " in flags:
        assert "avx512" in available_isas(lib, torch.bfloat16)


def test_bf16_output_is_the_fp32_result_rounded_like_torch(lib):
    """Rows whose sums are inf, nan, subnormal or near fp32's largest: the kernel's own rounding of its
    fp32 result agrees with torch's, bit for bit (nan as nan)."""
    k, n = 256, 50
    blocks = torch.from_numpy(_blocks("Q8_0", n, k, seed=9))
    x = _x(5, k, torch.float32)
    x[0, 3] = float("inf")
    x[1, :2] = torch.tensor([float("inf"), float("-inf")])
    x[2] *= 2.0 ** -118  # sums far below fp32's smallest normal
    x[3] *= 2.0 ** 115  # sums near fp32's largest
    x[4, 7] = float("nan")
    x = x.to(torch.bfloat16)
    y = BlockMatmul(lib, blocks, "Q8_0", k)(x)
    expected = _fp32_out(lib, blocks, "Q8_0", x).to(torch.bfloat16)
    same = (y.view(torch.int16) == expected.view(torch.int16)) | (y.isnan() & expected.isnan())
    assert bool(same.all())
    assert bool(y[0].isinf().any()) and bool(y[1].isnan().any()) and bool(y[4].isnan().all())


def test_fp32_out_is_the_unrounded_result_for_bf16_inputs(lib):
    """The LM head's call: bf16 activations, fp32 logits (bf16 logits would turn near-ties into ties)."""
    k, n = 256, 40
    blocks = torch.from_numpy(_blocks("Q4_K", n, k, seed=4))
    x = _x(3, k, torch.bfloat16)
    mm = BlockMatmul(lib, blocks, "Q4_K", k)
    y = mm(x, fp32_out=True)
    assert y.dtype == torch.float32 and torch.equal(y, _fp32_out(lib, blocks, "Q4_K", x))
    assert torch.equal(y.to(torch.bfloat16), mm(x))
    assert torch.equal(mm(x.float(), fp32_out=True), mm(x.float()))  # fp32 inputs: fp32 out either way


def test_large_n_and_leading_dimensions(lib):
    k, n = 256, 1000  # many tiles on each thread
    blocks_np = _blocks("Q4_K", n, k, seed=8)
    mm = BlockMatmul(lib, torch.from_numpy(blocks_np), "Q4_K", k)
    x = _x(6, k, torch.float32)
    y = mm(x.view(2, 3, k))
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    _assert_within(y.view(6, n), x, _reference(blocks_np, "Q4_K"))
    yb = mm(x.to(torch.bfloat16).view(3, 2, k))
    assert yb.shape == (3, 2, n) and yb.dtype == torch.bfloat16
    assert mm(x[:0]).shape == (0, n)


def test_refusals(lib):
    blocks = torch.from_numpy(_blocks("Q6_K", 4, 256))
    assert BlockMatmul.create(None, blocks, "Q6_K", 256) is None
    assert BlockMatmul.create(lib, blocks, "Q6_K", 100) is None
    assert BlockMatmul.create(lib, blocks, "Q6_K", 256) is not None
    with pytest.raises(RuntimeError, match="not built"):
        BlockMatmul(None, blocks, "Q6_K", 256)
    with pytest.raises(ValueError, match="fmt"):
        BlockMatmul(lib, blocks, "IQ2_XXS", 256)
    with pytest.raises(ValueError, match="k:"):
        BlockMatmul(lib, blocks, "Q6_K", 200)
    with pytest.raises(ValueError, match="blocks"):
        BlockMatmul(lib, blocks[:, :100], "Q6_K", 256)
    with pytest.raises(ValueError, match="isa"):
        BlockMatmul(lib, blocks, "Q6_K", 256, "neon")
    mm = BlockMatmul(lib, blocks, "Q6_K", 256)
    with pytest.raises(ValueError, match="x:"):
        mm(torch.zeros(1, 128))
    with pytest.raises(ValueError, match="x:"):
        mm(torch.zeros(1, 256, dtype=torch.float16))
    code = FORMATS["Q6_K"].code
    x, y = torch.zeros(1, 256), torch.zeros(1, 4)
    assert lib.gemm_blocks_f32(x.data_ptr(), 0, blocks.data_ptr(), 210, 99, y.data_ptr(), 1, 256, 4, 0, 1) == -1
    assert lib.gemm_blocks_f32(x.data_ptr(), 0, blocks.data_ptr(), 100, code, y.data_ptr(), 1, 256, 4, 0, 1) == -1
    assert lib.gemm_blocks_f32(x.data_ptr(), 0, blocks.data_ptr(), 210, code, y.data_ptr(), 1, 256, 4, 4, 1) == -2
    assert lib.gemm_blocks_f32(x.data_ptr(), 3, blocks.data_ptr(), 210, code, y.data_ptr(), 1, 256, 4, 0, 1) == -1


@pytest.mark.parametrize("isa", ["scalar", "avx512"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_ordered_gemv_equals_the_fp32_block_matmul_bit_for_bit(lib, fmt, isa):
    # Batch-invariant mode runs this GEMV at few rows and the block matmul above: the same chain.
    if isa not in [name for name, code in ISAS.items() if code and lib.gemv_ordered_isas_f32() & (1 << code)]:
        pytest.skip(f"no {isa} path on this CPU")  # the AVX-512 path exists on AVX-512 machines only
    k, n = _k(fmt), 37  # n: two whole groups of 16 weight rows and a part of one
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=4, zeros=True))
    x = _x(6, k, torch.float32)
    whole = _fp32_out(lib, blocks, fmt, x)
    gemv = OrderedGemv(lib, blocks, fmt, k, isa)
    for rows in (1, 2, 5, 6):
        assert torch.equal(gemv(x[:rows]), whole[:rows]), f"{rows} rows"
    assert torch.equal(gemv(x[3:4]), whole[3:4])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_ordered_bf16_gemv_equals_the_bf16_block_matmul_bit_for_bit(lib, fmt):
    if "avx512" not in available_isas(lib, torch.bfloat16):
        pytest.skip("the bf16 variants run on AVX512_BF16 CPUs only")  # elsewhere the engine runs fp32
    k, n = _k(fmt), 37
    blocks = torch.from_numpy(_blocks(fmt, n, k, seed=6, zeros=True))
    x = _x(6, k, torch.bfloat16)
    whole = _fp32_out(lib, blocks, fmt, x)
    rounded = BlockMatmul(lib, blocks, fmt, k)(x)
    gemv = OrderedGemv(lib, blocks, fmt, k)
    for rows in (1, 2, 5, 6):
        assert torch.equal(gemv(x[:rows], fp32_out=True), whole[:rows]), f"{rows} rows"
        assert torch.equal(gemv(x[:rows]), rounded[:rows]), f"{rows} rows, rounded to bf16"
