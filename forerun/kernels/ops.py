"""Fused residual-add + RMSNorm and SiLU-and-multiply from the C library (`csrc/fused_ops.c`), and
greedy sampling's argmax over logits in the model's dtype (`csrc/argmax.c`).

Each replaces four or five torch ops and their temporaries with one pass over memory. `NativeOps`
answers None where it cannot run an input (another device or dtype, a strided tensor), and the
caller then uses its stock-PyTorch expression.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from forerun.kernels.build import profiled

_SUFFIX = {torch.float32: "_f32", torch.bfloat16: "_bf16"}
# Below this many elements a pass takes a microsecond or less: one thread does it. Waking the
# others costs more, and on a busy machine a parallel region waits for its slowest thread's
# time slice (milliseconds) before the step can go on.
PARALLEL_MIN_ELEMENTS = 1 << 14


def threads_for(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1


class NativeOps:
    """Thin typed wrappers over the library's fused kernels. Inputs are never modified."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @staticmethod
    def _ok(*tensors: Tensor) -> bool:
        first = tensors[0]
        return (first.device.type == "cpu" and first.dtype in _SUFFIX
                and all(t.dtype == first.dtype and t.is_contiguous() for t in tensors))

    def add_rms_norm(self, x: Tensor, residual: Tensor | None, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor] | None:
        """(norm(x + residual) * weight, x + residual); with no residual, (norm(x) * weight, x)."""
        extra = () if residual is None else (residual,)
        if x.dim() != 2 or not self._ok(x, weight, *extra):
            return None
        out = torch.empty_like(x)
        res_out = torch.empty_like(x) if residual is not None else x
        fn = getattr(self.lib, "add_rms_norm" + _SUFFIX[x.dtype])
        with profiled("forerun::add_rms_norm"):
            fn(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
               res_out.data_ptr(), x.shape[0], x.shape[1], eps, threads_for(x.numel()))
        return out, res_out

    def argmax_rows(self, logits: Tensor) -> Tensor | None:
        """Each row's argmax as int64 [rows], as torch.argmax gives it (first index of the largest value,
        a NaN counting as the largest), read without a float32 copy of bf16 logits."""
        if logits.dim() != 2 or not self._ok(logits) or logits.shape[1] >= 1 << 31:
            return None
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        fn = getattr(self.lib, "argmax_rows" + _SUFFIX[logits.dtype])
        with profiled("forerun::argmax_rows"):
            fn(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), threads_for(logits.numel()))
        return out

    def silu_mul(self, gate_up: Tensor) -> Tensor | None:
        """silu(gate) * up for gate_up = [rows, 2 * inter] holding gate then up."""
        if gate_up.dim() != 2 or not self._ok(gate_up):
            return None
        inter = gate_up.shape[1] // 2
        out = gate_up.new_empty(gate_up.shape[0], inter)
        fn = getattr(self.lib, "silu_mul" + _SUFFIX[gate_up.dtype])
        with profiled("forerun::silu_mul"):
            fn(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, threads_for(gate_up.numel()))
        return out

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor | None:
        """x [T, heads * head_dim] (rows may be strided, e.g. q and k inside the packed projection)
        rotated by per-token cos/sin [T, 1, head_dim] (rotate-half factors, `sin` signed for the first half)
        -> [T, heads, head_dim]; None where the kernel does not take the input (then use the stock ops)."""
        tokens, width = x.shape
        if (x.dtype not in _SUFFIX or x.device.type != "cpu" or x.stride(1) != 1 or width % head_dim
                or head_dim % 2 or cos.dtype != x.dtype or sin.dtype != x.dtype
                or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)
                or cos.shape[0] != tokens):
            return None
        heads = width // head_dim
        out = x.new_empty(tokens, heads, head_dim)
        with profiled("forerun::rotary"):
            getattr(self.lib, "rotary" + _SUFFIX[x.dtype])(
                x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(), tokens,
                heads, head_dim, threads_for(x.numel()))
        return out
