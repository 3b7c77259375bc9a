"""oneDNN matmuls run at bucketed row counts, so that an engine's ever-changing batch sizes reuse the
few kernels oneDNN compiled instead of compiling one per row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from forerun.kernels.linear import available_kernels, in_row_buckets, make_linear, row_bucket

# bf16 oneDNN needs avx512bw or avx_ne_convert: on other CPUs only fp32 has the prepacked kernel.
PACKED_DTYPES = [d for d in (torch.float32, torch.bfloat16) if "mkldnn" in available_kernels(d, torch.device("cpu"))]


def test_buckets_cover_every_count_with_little_padding():
    buckets = [row_bucket(m) for m in range(1, 8193)]
    assert buckets[:16] == list(range(1, 17))  # a decode's few rows are run as they are
    assert all(m <= b <= m + m // 8 for m, b in zip(range(1, 8193), buckets))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= 100  # what oneDNN keeps (1,024 kernels) holds every bucket of 10 weights
    assert [row_bucket(m) for m in (17, 33, 100, 2048, 2049)] == [18, 36, 104, 2048, 2304]


def test_padded_rows_are_dropped():
    seen: list[int] = []

    def matmul(y: torch.Tensor) -> torch.Tensor:
        seen.append(y.shape[0])
        return y * 2 + 1

    x = torch.randn(33, 4)
    out = in_row_buckets(matmul, x)
    assert seen == [36]
    assert torch.equal(out, x * 2 + 1)
    assert in_row_buckets(matmul, x[:16]).shape == (16, 4) and seen[-1] == 16


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_the_prepacked_kernel_runs_at_the_bucket(dtype):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype), torch.randn(100, 64).to(dtype)
    fn = make_linear(w, b, "mkldnn", batch_hint=64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        got = fn(x)
    rows = [e.input_shapes[0][0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]
    assert rows == [104]
    want = F.linear(x.float(), w.float(), b.float())
    assert got.shape == (100, 96)
    assert (got.float() - want).abs().max() < (1e-4 if dtype == torch.float32 else 0.5)
