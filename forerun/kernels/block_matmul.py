"""Matmuls of many rows (prefill, batches of 16-256) over weights kept as GGUF blocks (`csrc/gemm_blocks.c`).

Where the GEMV (forerun.kernels.kquant_gemv) expands the blocks again for every few rows of x, this
kernel expands each weight once a call into a cache-resident tile and multiplies every row of x by
it, so at tens of rows it is bound by the products, as a dense matmul is. Two arithmetic variants,
picked by x's dtype:

  fp32 x: weights exactly gguf's fp32 values, fp32 products and sums (`x @ W.T` up to sum order);
  bf16 x: weights rounded to bf16 (nearest even), exact products, fp32 sums (AVX512_BF16 where built),
          rounded to bf16 once at the end, as a bf16 matmul over the rounded weights.

Choosing this kernel over the GEMV or stock PyTorch is the caller's job.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from forerun.kernels.build import profiled
from forerun.kernels.kquant_gemv import FORMATS, ISAS, check_blocks, supports

# gemm_blocks_f32's `mode`: fp32 x and y; bf16 x (the bf16 variant) and fp32 y; bf16 x and bf16 y.
MODE_F32, MODE_BF16, MODE_BF16_OUT = 0, 1, 2


def available_isas(lib: ctypes.CDLL, dtype: torch.dtype) -> list[str]:
    """The kernel paths built into `lib` for x of `dtype` (fp32 or bf16; "scalar" always). "avx2" is
    fp32's only; for bf16, "avx512" is the AVX512_BF16 dot-product path."""
    bits = lib.gemm_blocks_isas_f32(int(dtype == torch.bfloat16))
    return [name for name, code in ISAS.items() if code and bits & (1 << code)]


def vectorised(lib: ctypes.CDLL, dtype: torch.dtype) -> bool:
    """Whether the kernel has a vector path for x of `dtype` (fp32: AVX2 or AVX-512; bf16: AVX512_BF16).
    Without one it is the portable loop, no contender for the lane matmul or for fp32."""
    return any(isa != "scalar" for isa in available_isas(lib, dtype))


class BlockMatmul:
    """x -> x W^T with W [n, k] held as its GGUF blocks, uint8 [n, k / block weights * block bytes].

    Invariant: each output y[i, j] is summed over k in one fixed order that depends on k alone, so a
    row's result is bit-identical whatever the number of rows passed with it, its place among them
    and the thread count. fp32 x gives fp32 `x @ W.T` over gguf's exact weights (the AVX-512 and the
    portable path are bit-equal); bf16 x gives the bf16 rounding of an fp32-accumulated product with
    the weights rounded to bf16. `blocks` is kept (contiguous, on the CPU) for the kernel to read.
    Construction raises RuntimeError when the C library is missing (`create` gives None instead) and
    ValueError naming the field for input the kernel cannot run.
    """

    def __init__(self, lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int, isa: str = "auto") -> None:
        if lib is None or not hasattr(lib, "gemm_blocks_f32"):
            raise RuntimeError("the C kernels are not built (forerun.kernels.build): use the stock PyTorch path")
        check_blocks(blocks, fmt, k)
        if isa not in ISAS:
            raise ValueError(f"isa: {isa!r} is not one of {sorted(ISAS)}")
        self.lib, self.fn = lib, lib.gemm_blocks_f32
        self.blocks = blocks.contiguous()
        self.fmt, self.k, self.n = fmt, k, blocks.shape[0]
        self.code, self.isa = FORMATS[fmt].code, isa

    @classmethod
    def create(cls, lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int) -> BlockMatmul | None:
        """The kernel for this weight, or None where it cannot run it (no library, format or k it lacks)."""
        if lib is None or not hasattr(lib, "gemm_blocks_f32") or not supports(fmt, k):
            return None
        return cls(lib, blocks, fmt, k)

    def __call__(self, x: Tensor, fp32_out: bool = False) -> Tensor:
        """x [..., k] fp32 or bf16 -> [..., n] in x's dtype (computed in fp32, rounded once for bf16), or
        in fp32 whatever x's dtype with `fp32_out` (logits: rounding them to bf16 makes near-ties ties)."""
        if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
            raise ValueError(f"x: expected float32 or bfloat16 on the CPU, got {x.dtype} on {x.device}")
        if x.shape[-1] != self.k:
            raise ValueError(f"x: last dimension {x.shape[-1]} is not k={self.k}")
        if self.isa != "auto" and self.isa not in available_isas(self.lib, x.dtype):
            raise ValueError(f"isa: {self.isa!r} is not built for {x.dtype} on this CPU "
                             f"(built: {available_isas(self.lib, x.dtype)})")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.k).contiguous()
        out_dtype = torch.float32 if fp32_out else x.dtype
        y = torch.empty(flat.shape[0], self.n, dtype=out_dtype)  # bf16: the kernel rounds its fp32 result once
        mode = MODE_F32 if x.dtype == torch.float32 else MODE_BF16 if fp32_out else MODE_BF16_OUT
        with profiled("forerun::linear_blocks"):
            rc = self.fn(flat.data_ptr(), mode, self.blocks.data_ptr(), self.blocks.shape[1], self.code, y.data_ptr(),
                         flat.shape[0], self.k, self.n, ISAS[self.isa], torch.get_num_threads())
        if rc == -3:
            raise MemoryError(f"gemm_blocks_f32: no memory for {flat.shape[0]} rows of k={self.k}")
        if rc != 0:  # checked at construction, so this is a mismatch between this file and the C one
            raise RuntimeError(f"gemm_blocks_f32 refused {self.fmt} k={self.k} (code {rc})")
        return y.view(*lead, self.n)


class OrderedGemv:
    """x -> x W^T for a few rows over W's GGUF blocks (`csrc/gemv_ordered.c`), summed in `BlockMatmul`'s
    order: the same results bit for bit (fp32 x: the fp32 variant; bf16 x: the bf16 variant, which has
    an AVX512_BF16 path only), at the cost of a GEMV rather than a batched matmul. Batch-invariant mode
    runs it below a few rows and the block matmul above, so a row's result is the same at every row
    count. Same invariants and errors as `BlockMatmul`."""

    def __init__(self, lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int, isa: str = "auto") -> None:
        if lib is None or not hasattr(lib, "gemv_ordered_f32"):
            raise RuntimeError("the C kernels are not built (forerun.kernels.build): use the stock PyTorch path")
        check_blocks(blocks, fmt, k)
        built = [name for name, code in ISAS.items() if code and lib.gemv_ordered_isas_f32() & (1 << code)]
        if isa != "auto" and isa not in built:
            raise ValueError(f"isa: {isa!r} is not one of the paths built for this CPU: {built}")
        self.fns = {torch.float32: lib.gemv_ordered_f32, torch.bfloat16: lib.gemv_ordered_bf16}
        self.blocks = blocks.contiguous()
        self.fmt, self.k, self.n = fmt, k, blocks.shape[0]
        self.code, self.isa = FORMATS[fmt].code, isa

    def __call__(self, x: Tensor, fp32_out: bool = False) -> Tensor:
        """x [..., k] fp32 or bf16 -> [..., n] in x's dtype (bf16: the fp32 result rounded once, as the
        block matmul rounds), or fp32 with `fp32_out`."""
        if x.dtype not in self.fns or x.device.type != "cpu" or x.shape[-1] != self.k:
            raise ValueError(f"x: expected float32 or bfloat16 [..., {self.k}] on the CPU, got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.k).contiguous()
        y = torch.empty(flat.shape[0], self.n, dtype=torch.float32)
        with profiled("forerun::linear_ordered"):
            rc = self.fns[x.dtype](flat.data_ptr(), self.blocks.data_ptr(), self.blocks.shape[1], self.code,
                                   y.data_ptr(), flat.shape[0], self.k, self.n, ISAS[self.isa], torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"x: no {x.dtype} path of the ordered GEMV on this CPU (bf16 needs AVX512_BF16)")
        if rc != 0:  # checked at construction, so this is a mismatch between this file and the C one
            raise RuntimeError(f"gemv_ordered refused {self.fmt} k={self.k} (code {rc})")
        return y.view(*lead, self.n) if fp32_out else y.view(*lead, self.n).to(x.dtype)
