"""Matmuls of many rows over GGUF blocks, summed in the block GEMV's order (`csrc/gemm_lanes.c`).

The block GEMV (forerun.kernels.kquant_gemv) is the fastest kernel at one row, and its order of sums
is fixed per output: 16 lanes over k, then a fixed tree. This kernel expands a tile of weight rows
once a call into cache (as the block matmul does, so many rows cost products, not decoding) and runs
that same order over it, so its results are the GEMV's bit for bit at every row count. A model whose
GGUF matmuls run the GEMV at few rows and this kernel at many gives a row the same result however it
is batched, at no cost to one user.

Arithmetic: fp32 over gguf's exact weights; bf16 inputs are widened exactly and the result rounded
once, as the GEMV does. Choosing this kernel is the caller's job.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from forerun.kernels.build import profiled
from forerun.kernels.kquant_gemv import FORMATS, ISAS, check_blocks, fp32_rows, shaped_like, supports


def available_isas(lib: ctypes.CDLL) -> list[str]:
    """The kernel paths built into `lib` for this CPU ("scalar" always)."""
    bits = lib.gemm_lanes_isas_f32()
    return [name for name, code in ISAS.items() if code and bits & (1 << code)]


class LaneMatmul:
    """x -> x W^T with W [n, k] held as its GGUF blocks, uint8 [n, k / block weights * block bytes].

    Invariant: each output is summed exactly as `KQuantGemv` sums it (the same bits for the same row,
    whatever the number of rows passed with it or of threads); `blocks` is kept (contiguous, on the
    CPU) for the kernel to read. Construction raises RuntimeError when the C library is missing
    (`create` gives None instead) and ValueError naming the field for input the kernel cannot run.
    """

    def __init__(self, lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int, isa: str = "auto") -> None:
        if lib is None or not hasattr(lib, "gemm_lanes_f32"):
            raise RuntimeError("the C kernels are not built (forerun.kernels.build): use the stock PyTorch path")
        check_blocks(blocks, fmt, k)
        if isa not in ISAS:
            raise ValueError(f"isa: {isa!r} is not one of {sorted(ISAS)}")
        if isa != "auto" and isa not in available_isas(lib):
            raise ValueError(f"isa: {isa!r} is not built for this CPU (built: {available_isas(lib)})")
        self.fn = lib.gemm_lanes_f32
        self.blocks = blocks.contiguous()
        self.fmt, self.k, self.n = fmt, k, blocks.shape[0]
        self.code, self.isa = FORMATS[fmt].code, ISAS[isa]

    @classmethod
    def create(cls, lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int) -> LaneMatmul | None:
        """The kernel for this weight, or None where it cannot run it (no library, format or k it lacks)."""
        if lib is None or not hasattr(lib, "gemm_lanes_f32") or not supports(fmt, k):
            return None
        return cls(lib, blocks, fmt, k)

    def __call__(self, x: Tensor, fp32_out: bool = False) -> Tensor:
        """x [..., k] fp32 or bf16 -> [..., n] in x's dtype (bf16: computed in fp32, rounded once), or
        the fp32 result with `fp32_out` (logits)."""
        flat = fp32_rows(x, self.k)
        y = flat.new_empty(flat.shape[0], self.n)
        with profiled("forerun::linear_lanes"):
            rc = self.fn(flat.data_ptr(), self.blocks.data_ptr(), self.blocks.shape[1], self.code, y.data_ptr(),
                         self.n, flat.shape[0], self.k, self.n, self.isa, torch.get_num_threads())
        if rc == -3:
            raise MemoryError(f"gemm_lanes_f32: no memory for a tile of k={self.k}")
        if rc != 0:  # checked at construction, so this is a mismatch between this file and the C one
            raise RuntimeError(f"gemm_lanes_f32 refused {self.fmt} k={self.k} (code {rc})")
        return shaped_like(y, x, fp32_out)
