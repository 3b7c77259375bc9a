"""ggml's first block formats: 32 elements a block, one fp16 scale `d` (and a minimum `m` for the
`_1` kinds), 4, 5 or 8 bits an element.

Layouts (bytes, in order), from ggml's block structs:
  Q4_0 (18): d, qs[16]            y = d * (q - 8),  q = 4 bits
  Q4_1 (20): d, m, qs[16]         y = d * q + m
  Q5_0 (22): d, qh[4], qs[16]     y = d * (q - 16), q = 4 low bits from qs, 5th bit from qh
  Q5_1 (24): d, m, qh[4], qs[16]  y = d * q + m
  Q8_0 (34): d, qs[32] (int8)     y = q * d
Element j < 16 takes the low nibble of qs[j]; element j + 16 its high nibble. The fifth bit of
element j is bit j of qh read as a little-endian uint32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from forerun.kernels.formats.common import QuantFormat, half, little_endian_bits, nibbles, signed


def _five_bit(blocks: Tensor, qh_at: int) -> Tensor:
    """The 32 five-bit codes of Q5_0 / Q5_1 blocks whose qh field starts at byte `qh_at`."""
    high = little_endian_bits(blocks[:, qh_at:qh_at + 4])
    return nibbles(blocks[:, qh_at + 4:qh_at + 20]) | (high << 4)


def _q4_0(blocks: Tensor) -> Tensor:
    return half(blocks, 0) * signed(nibbles(blocks[:, 2:18]), 8)


def _q4_1(blocks: Tensor) -> Tensor:
    return half(blocks, 0) * nibbles(blocks[:, 4:20]).float() + half(blocks, 2)


def _q5_0(blocks: Tensor) -> Tensor:
    return half(blocks, 0) * signed(_five_bit(blocks, 2), 16)


def _q5_1(blocks: Tensor) -> Tensor:
    return half(blocks, 0) * _five_bit(blocks, 4).float() + half(blocks, 2)


def _q8_0(blocks: Tensor) -> Tensor:
    return blocks[:, 2:34].contiguous().view(torch.int8).float() * half(blocks, 0)


LEGACY_FORMATS = (
    QuantFormat("Q4_0", 2, 32, 18, _q4_0, (0,)),
    QuantFormat("Q4_1", 3, 32, 20, _q4_1, (0, 2)),
    QuantFormat("Q5_0", 6, 32, 22, _q5_0, (0,)),
    QuantFormat("Q5_1", 7, 32, 24, _q5_1, (0, 2)),
    QuantFormat("Q8_0", 8, 32, 34, _q8_0, (0,)),
)
