"""The unquantized storage types: each element is its own one-element block."""

from __future__ import annotations

import torch
from torch import Tensor

from forerun.kernels.formats.common import QuantFormat


def _f32(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16(blocks: Tensor) -> Tensor:
    # bf16 is the top half of an fp32, so widening is exact (NaN payloads included).
    return blocks.contiguous().view(torch.bfloat16).float()


FLOAT_FORMATS = (
    QuantFormat("F32", 0, 1, 4, _f32),
    QuantFormat("F16", 1, 1, 2, _f16),
    QuantFormat("BF16", 30, 1, 2, _bf16),
)
