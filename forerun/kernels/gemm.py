"""fp32 matmuls of any row count over a weight packed once at load (`csrc/gemm_packed.c`).

The third matmul kernel beside `aten` and `mkldnn` (forerun.kernels.linear): the CPU probe times
it on the model's own shapes and keeps it where it is the fastest.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from forerun.kernels.build import build_name, profiled
from forerun.kernels.types import LinearFn

PANEL = 16  # output columns per packed panel (NR in gemm_packed.c)


class PackedGemm:
    """Wraps the C kernel; `linear` packs a weight and returns x -> x W^T + b over the packed copy."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack = lib.pack_weight_f32
        self._gemm = lib.gemm_packed_f32
        self.build = build_name(lib)

    def pack(self, weight: Tensor) -> Tensor:
        """The [n, k] fp32 weight as panels of 16 output columns (zero-padded), one flat tensor."""
        n, k = weight.shape
        w = weight.detach().to(torch.float32).contiguous()
        packed = torch.empty(-(-n // PANEL) * PANEL * k, dtype=torch.float32)
        self._pack(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
        return packed

    def linear(self, weight: Tensor, bias: Tensor | None) -> LinearFn:
        n, k = weight.shape
        packed = self.pack(weight)
        padded = None
        if bias is not None:  # the kernel reads whole panels of bias
            padded = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
            padded[:n] = bias.detach().to(torch.float32)
        return lambda x: self(x, packed, padded, n, k)

    def __call__(self, x: Tensor, packed: Tensor, bias: Tensor | None, n: int, k: int) -> Tensor:
        if x.dtype != torch.float32:
            raise ValueError(f"linear_kernel: native matmuls take float32 inputs, got {x.dtype}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, k).contiguous()
        y = flat.new_empty(flat.shape[0], n)
        with profiled("forerun::linear_packed"):
            self._gemm(flat.data_ptr(), flat.shape[0], k, packed.data_ptr(),
                       None if bias is None else bias.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
        return y.view(*lead, n)
