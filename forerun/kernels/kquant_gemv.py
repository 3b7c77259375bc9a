"""Small-batch matmuls over GGUF blocks as the file stores them (`csrc/gemv_kquant.c`).

Formats: the legacy Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, and IQ4_NL, IQ4_XS. Each
weight is expanded in registers to exactly the fp32 value gguf's dequantizer gives, and multiplied by
fp32 activations, so the result is fp32 `x @ W.T` over the dequantized weights up to the order of the
sums. That order is fixed per output, so a row's result never depends on the other rows passed with
it nor on the thread count.
With `activation_bits` 16 or 8 the formats in INT_FORMATS run `csrc/gemv_int.c` instead: x is
rounded to that many bits per block of 32 and multiplied in integers, faster at one row and no longer
the fp32 result: within about 2^-16 of it at 16 bits, 2^-8 at 8 (llama.cpp's choice); its order of
sums is fixed too.
Choosing this kernel over stock PyTorch (and falling back) is the caller's job.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
from torch import Tensor

from forerun.kernels.build import profiled
from forerun.kernels.formats import QUANT_FORMATS


class BlockFormat(NamedTuple):
    """One GGUF block format: its ggml type code (the kernel's format code), weights and bytes a block."""

    code: int
    weights: int
    bytes: int


# The formats the kernel reads, with their layout from the one table of GGML formats.
FORMATS: dict[str, BlockFormat] = {
    name: BlockFormat(QUANT_FORMATS[name].ggml_type, QUANT_FORMATS[name].block_size, QUANT_FORMATS[name].block_bytes)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")}
# The formats the GEMV over integer activations reads (the others keep fp32 activations whatever
# activation_bits says).
INT_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# The widths a GEMV's activations may have: 32 is fp32 (exact), 16 and 8 are integers per block of 32.
ACTIVATION_BITS = (32, 16, 8)
# The kernel's paths: "auto" takes the widest one built for this CPU; the others exist to test them.
ISAS: dict[str, int] = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}


def supports(fmt: str, k: int) -> bool:
    """Whether the kernel runs rows of `k` weights in format `fmt` (k a whole number of blocks)."""
    spec = FORMATS.get(fmt)
    return spec is not None and k > 0 and k % spec.weights == 0


def check_blocks(blocks: Tensor, fmt: str, k: int) -> None:
    """Raise ValueError naming the field unless `blocks` is a CPU uint8 [n, row bytes] tensor holding
    rows of `k` weights in format `fmt`, a format the kernels read, with k a whole number of blocks."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: {fmt!r} is not one of {sorted(FORMATS)}")
    if not supports(fmt, k):
        raise ValueError(f"k: {k} is not a positive multiple of {fmt}'s {FORMATS[fmt].weights} weights a block")
    row_bytes = k // FORMATS[fmt].weights * FORMATS[fmt].bytes
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
        raise ValueError(f"blocks: expected uint8 [n, {row_bytes}] for {fmt} with k={k}, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    if blocks.device.type != "cpu":
        raise ValueError(f"blocks: must be on the CPU, not {blocks.device}")


def dequantize_blocks(lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int) -> Tensor:
    """uint8 [n, row bytes] rows of `fmt` blocks -> float32 [n, k] (`csrc/dequant_blocks.c`).

    Invariant: every value is bit-identical to gguf.quants.dequantize's (signs of zeros included), and
    to the weight the GEMV and the block GEMM multiply by. RuntimeError when the C library is missing,
    ValueError (naming the field) for input it cannot read.
    """
    if lib is None or not hasattr(lib, "dequant_rows_f32"):
        raise RuntimeError("the C kernels are not built (forerun.kernels.build): use formats.dequantize_rows")
    check_blocks(blocks, fmt, k)
    blocks = blocks.contiguous()
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    with profiled("forerun::dequant_blocks"):
        rc = lib.dequant_rows_f32(blocks.data_ptr(), blocks.shape[1], FORMATS[fmt].code, blocks.shape[0], k,
                                  out.data_ptr(), torch.get_num_threads())
    if rc != 0:  # checked above, so this is a mismatch between this file and the C one
        raise RuntimeError(f"dequant_rows_f32 refused {fmt} k={k} (code {rc})")
    return out


def fp32_rows(x: Tensor, k: int) -> Tensor:
    """x [..., k] fp32 or bf16 on the CPU as a contiguous fp32 [rows, k] (bf16 -> fp32 is exact), what the
    block kernels read; ValueError naming x for anything else."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"x: expected float32 or bfloat16 on the CPU, got {x.dtype} on {x.device}")
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension {x.shape[-1]} is not k={k}")
    return x.reshape(-1, k).to(torch.float32).contiguous()


def shaped_like(y: Tensor, x: Tensor, fp32_out: bool) -> Tensor:
    """A block kernel's fp32 [rows, n] result with x's leading dimensions, in x's dtype (rounded once)
    or, with `fp32_out`, in fp32 (logits)."""
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if fp32_out else y.to(x.dtype)


def available_isas(lib: ctypes.CDLL, activation_bits: int = 32) -> list[str]:
    """The kernel paths built into `lib` for this CPU ("scalar" always); the GEMV over integer
    activations has "scalar", "avx2" (which uses AVX-512 VNNI's 256-bit dot product for 8 bits where
    the CPU has it) and, with AVX-512 BW and VNNI, "avx512"."""
    built = lib.gemv_kquant_isas_f32() if activation_bits == 32 else lib.gemv_int_isas_f32()
    return [name for name, code in ISAS.items() if code and built & (1 << code)]


class KQuantGemv:
    """x -> x W^T with W [n, k] held as its GGUF blocks, uint8 [n, k / block weights * block bytes].

    Invariant: `blocks` is contiguous, on the CPU and kept alive by this object for the kernel to read;
    every output is summed in one fixed order, so results are bit-identical whatever the number of rows
    of x or of threads. Construction raises RuntimeError when the C library is missing (use `create` to
    get None instead) and ValueError naming the field for input the kernel cannot run.
    """

    def __init__(self, lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int, isa: str = "auto",
                 activation_bits: int = 32) -> None:
        if lib is None or not hasattr(lib, "gemv_kquant_f32"):
            raise RuntimeError("the C kernels are not built (forerun.kernels.build): use the stock PyTorch path")
        check_blocks(blocks, fmt, k)
        if activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits: expected one of {ACTIVATION_BITS}, got {activation_bits!r}")
        if activation_bits != 32 and fmt not in INT_FORMATS:
            raise ValueError(f"fmt: {fmt} has no GEMV over integer activations (those read {', '.join(INT_FORMATS)})")
        if isa not in ISAS:
            raise ValueError(f"isa: {isa!r} is not one of {sorted(ISAS)}")
        built = available_isas(lib, activation_bits)
        if isa != "auto" and isa not in built:
            raise ValueError(f"isa: {isa!r} is not built for this CPU (built: {built})")
        spec = FORMATS[fmt]
        self.activation_bits = activation_bits
        self.lib, self.blocks = lib, blocks.contiguous()
        self.fmt, self.k, self.n = fmt, k, blocks.shape[0]
        self.code, self.isa = spec.code, ISAS[isa]

    @classmethod
    def create(cls, lib: ctypes.CDLL | None, blocks: Tensor, fmt: str, k: int,
               activation_bits: int = 32) -> KQuantGemv | None:
        """The kernel for this weight, or None where it cannot run it (no library, format or k it lacks);
        `activation_bits` 16 or 8 applies where the format has that GEMV (INT_FORMATS), else fp32 runs."""
        if lib is None or not hasattr(lib, "gemv_kquant_f32") or not supports(fmt, k):
            return None
        return cls(lib, blocks, fmt, k, activation_bits=activation_bits if fmt in INT_FORMATS else 32)

    def __call__(self, x: Tensor, fp32_out: bool = False) -> Tensor:
        """x [..., k] fp32 or bf16 -> [..., n] in x's dtype (bf16: computed in fp32, rounded once), or
        the fp32 result with `fp32_out` (logits)."""
        flat = fp32_rows(x, self.k)
        y = flat.new_empty(flat.shape[0], self.n)
        args = (flat.data_ptr(), self.blocks.data_ptr(), self.blocks.shape[1], self.code)
        tail = (y.data_ptr(), flat.shape[0], self.k, self.n, self.isa, torch.get_num_threads())
        if self.activation_bits == 32:
            with profiled("forerun::linear_kquant"):
                rc = self.lib.gemv_kquant_f32(*args, *tail)
        else:
            with profiled(f"forerun::linear_int{self.activation_bits}"):
                rc = self.lib.gemv_int_f32(*args, self.activation_bits, *tail)
        if rc != 0:  # checked at construction, so this is a mismatch between this file and the C one
            raise RuntimeError(f"the block GEMV ({self.activation_bits}-bit activations) refused {self.fmt} "
                               f"k={self.k} (code {rc})")
        return shaped_like(y, x, fp32_out)
