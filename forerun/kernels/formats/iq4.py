"""ggml's non-linear 4-bit formats: each 4-bit code indexes a fixed table of 16 signed levels
(denser near zero, where weights are), scaled by an fp16 `d`.

Layouts (bytes, in order), from ggml's block structs:
  IQ4_NL (18):  d, qs[16]                              32 elements; y = d * level[q]
  IQ4_XS (136): d, scales_h (uint16), scales_l[4], qs[128]
                256 elements in 8 sub-blocks of 32, each with a 6-bit scale minus 32:
                y = (d * scale) * level[q]
Within every 32 elements, element j < 16 is the low nibble of byte j, element j + 16 its high nibble.
"""

from __future__ import annotations

import torch
from torch import Tensor

from forerun.kernels.formats.common import QuantFormat, bit_planes, half, nibbles, signed

# ggml's kvalues_iq4nl: the 16 levels a code selects.
LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _levels(codes: Tensor) -> Tensor:
    return torch.tensor(LEVELS, dtype=torch.float32)[codes.long()]


def _iq4_nl(blocks: Tensor) -> Tensor:
    return half(blocks, 0) * _levels(nibbles(blocks[:, 2:18]))


def _iq4_xs(blocks: Tensor) -> Tensor:
    # Sub-block i: low four scale bits are nibble i % 2 of scales_l[i // 2], top two are bits
    # 2i..2i+1 of the little-endian scales_h.
    low = bit_planes(blocks[:, 4:8], 4, 2).transpose(1, 2).reshape(-1, 8)
    top = bit_planes(blocks[:, 2:4], 2, 4).transpose(1, 2).reshape(-1, 8)
    scale = half(blocks, 0) * signed(low | (top << 4), 32)
    codes = nibbles(blocks[:, 8:136].reshape(-1, 8, 16))
    return (scale.unsqueeze(-1) * _levels(codes)).view(-1, 256)


IQ4_FORMATS = (
    QuantFormat("IQ4_NL", 20, 32, 18, _iq4_nl, (0,)),
    QuantFormat("IQ4_XS", 23, 256, 136, _iq4_xs, (0,)),
)
