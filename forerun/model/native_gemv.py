"""Small-batch matmuls over compact weights with fp32 arithmetic (`native/gemv_compact.c`).

At one to a few decode rows a matmul is bound by reading its weights. Where a weight's bf16 or
GGUF-block form (forerun.model.compact_weights) expands exactly to the fp32 weight, reading that
form moves 2x (bf16) to 6x (Q4_1) fewer bytes for the same result up to summation order.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from forerun.model.compact_weights import CompactWeight
from forerun.model.linear_kernels import LinearFn
from forerun.model.native_build import build_name, profiled


class CompactGemv:
    """Wraps the C kernel; `linear` answers None where the kernel cannot run a weight."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.gemv_compact_f32
        self.build = build_name(lib)

    def linear(self, weight: CompactWeight | None, bias: Tensor | None) -> LinearFn | None:
        """x -> x W^T + b reading `weight`'s compact form, or None for a shape the kernel lacks."""
        if weight is None or weight.k % (8 if weight.fmt == "bf16" else 32):
            return None
        b = None if bias is None else bias.detach().float().contiguous()
        return lambda x: self(x, weight, b)

    def __call__(self, x: Tensor, weight: CompactWeight, bias: Tensor | None) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, weight.k).to(torch.float32).contiguous()
        n = weight.data.shape[0]
        y = flat.new_empty(flat.shape[0], n)
        with profiled("forerun::linear_compact"):
            self.fn(flat.data_ptr(), weight.data.data_ptr(), weight.data.shape[1], weight.code,
                    None if bias is None else bias.data_ptr(), y.data_ptr(), flat.shape[0], weight.k, n,
                    torch.get_num_threads())
        return y.view(*lead, n)
