"""Small-batch matmuls over bf16-stored weights with fp32 arithmetic (`native/gemv_bf16w.c`).

At one to a few decode rows a matmul is bound by reading its weights. Checkpoints mostly store
them in bf16, and an fp32 model upcasts them at load, doubling what every step reads. When a
weight survives the round trip to bf16 unchanged, this keeps the bf16 copy and widens it in
registers: the bytes halve and the result is the fp32 matmul's up to summation order.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from forerun.model.linear_kernels import LinearFn


class BF16WeightGemv:
    """Wraps the C kernel; `linear` answers None where it cannot run a weight exactly."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.gemv_bf16w_f32

    def linear(self, weight: Tensor, bias: Tensor | None) -> LinearFn | None:
        """x -> x W^T + b reading a bf16 copy of `weight`, or None when that copy would not be exact
        (an fp32 checkpoint, a quantized one dequantized) or the shape does not fit the kernel."""
        if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
                or weight.shape[1] % 8 or weight.shape[0] == 0):
            return None
        half = weight.detach().to(torch.bfloat16)
        if not torch.equal(half.float(), weight):
            return None
        b = None if bias is None else bias.detach().float().contiguous()
        return lambda x: self(x, half, b)

    def __call__(self, x: Tensor, half: Tensor, bias: Tensor | None) -> Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, half.shape[1]).to(torch.float32).contiguous()
        y = flat.new_empty(flat.shape[0], half.shape[0])
        self.fn(flat.data_ptr(), half.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                flat.shape[0], flat.shape[1], half.shape[0], torch.get_num_threads())
        return y.view(*lead, half.shape[0])
