"""forerun's packed fp32 GEMM (`csrc/gemm_packed.c`): matches F.linear at every edge of its blocking
and is one of the probe's candidates (an engine on it gives the aten engine's tokens: test_cpu_kernels)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from forerun import LLM
from forerun.kernels.linear import available_kernels, make_linear
from forerun.kernels.build import load_native_library
from forerun.kernels.gemm import PackedGemm
from forerun.kernels import probe
from tests.conftest import judge_machine
from forerun.loader.model_source import cache_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gemm() -> PackedGemm:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return PackedGemm(lib)


# Rows around the 6-row micro-tile and the 96-row block; columns around the 16-wide panel.
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 64, 95, 96, 97, 200])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_f_linear(gemm, rows, n, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    k = 37
    w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(rows, k, generator=gen)
    bias = b if with_bias else None
    got = make_linear(w, bias, "native", 64, gemm)(x)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
    assert got.shape == want.shape == (rows, n)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gemm_takes_leading_dims_and_non_contiguous_inputs_and_refuses_bf16(gemm):
    w = torch.randn(24, 32)
    fn = make_linear(w, None, "native", 64, gemm)
    x = torch.randn(3, 5, 64)[..., ::2]  # strided last dim
    assert torch.allclose(fn(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="linear_kernel"):
        fn(torch.randn(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="linear_kernel"):
        make_linear(w, None, "native", 64)  # no C library


def test_the_result_does_not_depend_on_the_thread_count(gemm):
    x, w = torch.randn(64, 300), torch.randn(200, 300)
    fn = make_linear(w, None, "native", 64, gemm)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(x)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(one, fn(x)), "each output sums over k in one order, whatever the threads"
    finally:
        torch.set_num_threads(threads)


def test_native_is_a_candidate_for_fp32_only_when_the_library_built(gemm, tmp_path, monkeypatch):
    assert available_kernels(torch.float32, CPU, gemm) == ["aten", "mkldnn", "native"]
    assert "native" not in available_kernels(torch.float32, CPU)
    assert "native" not in available_kernels(torch.bfloat16, CPU, gemm)
    judge_machine(monkeypatch, False)
    cache = tmp_path / "probe.json"
    shapes = [(64, 96, 2), (96, 64, 2)]
    choice = probe.choose_kernels(shapes, 8, [torch.float32], None, cache, gemm)
    assert set(choice.gflops) == {"float32/aten", "float32/mkldnn", "float32/native"}
    assert f"{choice.dtype}/{choice.linear_kernel}" == max(choice.gflops, key=choice.gflops.get)
    # The key names the C build, so a changed kernel source is timed again.
    assert gemm.build and gemm.build in next(iter(json.loads(cache.read_text())))


def test_native_needs_the_c_kernels(tiny_llama_dir):
    with pytest.raises(ValueError, match="linear_kernel"):
        LLM(model=str(tiny_llama_dir), dtype="float32", linear_kernel="native", native_kernels=False,
            show_progress=False)
