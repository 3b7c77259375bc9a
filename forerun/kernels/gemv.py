"""Small-batch matmuls over compact weights with fp32 arithmetic (`csrc/gemv_compact.c`).

At one to a few decode rows a matmul is bound by reading its weights. Reading a weight's bf16 form
(where that holds the fp32 weight exactly) or a GGUF file's Q8_0/Q4_0/Q4_1 blocks
(forerun.kernels.compact_weights) moves 2x (bf16) to 6x (Q4_1) fewer bytes than fp32.

A bf16 engine uses the same kernel: its activations convert to fp32 at the kernel boundary (exact)
and the output rounds back to bf16, so the matmul is the fp32 one over the expanded weights.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from forerun.kernels.build import build_name, profiled
from forerun.kernels.compact_weights import CompactWeight


MAX_BLOCKS = 1024  # the kernel's per-row buffer of scales: k up to 32,768 in the GGUF formats


@dataclass(frozen=True)
class CompactLinear:
    """x -> x W^T + b over one weight in the kernel's layout; its fields are what the fused decode
    step (forerun.kernels.decode) hands to C."""

    gemv: CompactGemv
    packed: Tensor  # uint8 [(n + 3) // 4, 4 * row bytes]
    code: int  # the format code the kernel knows
    k: int
    n: int
    bias: Tensor | None  # fp32, contiguous
    fp32_out: bool = False  # True: fp32 output whatever the input's dtype (logits: bf16 would round them)

    def __call__(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.k).to(torch.float32).contiguous()  # bf16 -> fp32 is exact
        y = flat.new_empty(flat.shape[0], self.n)
        with profiled("forerun::linear_compact"):
            self.gemv.fn(flat.data_ptr(), self.packed.data_ptr(), self.packed.shape[1], self.code,
                         None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), flat.shape[0], self.k,
                         self.n, torch.get_num_threads())
        # The caller's dtype out: a bf16 engine's next op (norm, attention, cache write) takes bf16.
        return y.view(*lead, self.n) if self.fp32_out else y.view(*lead, self.n).to(x.dtype)


class CompactGemv:
    """Wraps the C kernel; `linear` answers None where the kernel cannot run a weight."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.gemv_compact_f32
        self.pack_fn = lib.gemv_pack_f32
        self.build = build_name(lib)

    def linear(self, weight: CompactWeight | None, bias: Tensor | None, fp32_out: bool = False) -> CompactLinear | None:
        """x -> x W^T + b reading `weight`'s compact form, or None for a shape the kernel lacks; the
        output has x's dtype unless `fp32_out`."""
        if weight is None or weight.k % (8 if weight.fmt == "bf16" else 32) or weight.k // 32 > MAX_BLOCKS:
            return None
        b = None if bias is None else bias.detach().float().contiguous()
        return CompactLinear(self, self.pack(weight), weight.code, weight.k, weight.data.shape[0], b, fp32_out)

    def pack(self, weight: CompactWeight) -> Tensor:
        """The kernel's own layout of `weight` (groups of 4 rows read front to back; see the C file),
        made once: the same bytes as the GGUF blocks plus at most 3 zero rows."""
        data = weight.data.contiguous()
        n, row_bytes = data.shape
        packed = torch.zeros((n + 3) // 4, 4 * row_bytes, dtype=torch.uint8)
        self.pack_fn(data.data_ptr(), weight.code, n, weight.k, packed.data_ptr())
        return packed
