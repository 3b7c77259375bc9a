"""ggml's k-quants: super-blocks of 256 elements split into sub-blocks that each carry a small
integer scale (and minimum), themselves scaled by the super-block's fp16 `d` (and `dmin`).

Layouts (bytes, in order), from ggml's block structs:
  Q2_K (84):  scales[16], qs[64], d, dmin          16 sub-blocks of 16; scale/min = low/high nibble
  Q3_K (110): hmask[32], qs[64], scales[12], d     16 sub-blocks of 16; 6-bit signed scales (-32)
  Q4_K (144): d, dmin, scales[12], qs[128]         8 sub-blocks of 32; 6-bit scales and mins
  Q5_K (176): d, dmin, scales[12], qh[32], qs[128] as Q4_K plus a fifth bit per element from qh
  Q6_K (210): ql[128], qh[64], scales[16], d       16 sub-blocks of 16; int8 scales
Values: y = (d * scale) * q - (dmin * min) where there is a minimum, y = (d * scale) * q otherwise,
computed in that order so the result is bit-identical to ggml's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from forerun.kernels.formats.common import QuantFormat, bit_planes, half, nibbles, signed


def _two_bit_codes(qs: Tensor) -> Tensor:
    """Q2_K / Q3_K low bits: element h*128 + j*32 + l is bits 2j..2j+1 of qs[h*32 + l] -> [n, 256]."""
    return bit_planes(qs.reshape(-1, 2, 32), 2, 4).reshape(-1, 256)


def _scales_and_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, float32 [n, 8, 1] each.

    Bytes 0-3 hold scales 0-3 in their low six bits, bytes 4-7 mins 0-3; scales and mins 4-7 take
    their low four bits from the nibbles of bytes 8-11 and their top two from the spare bits of 0-7.
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((a & 63, (c & 0x0F) | ((a >> 6) << 4)), dim=1)
    mins = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=1)
    return scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)


def _q2_k(blocks: Tensor) -> Tensor:
    packed = blocks[:, 0:16]
    scale = half(blocks, 80).unsqueeze(-1) * (packed & 0x0F).float().unsqueeze(-1)
    minimum = half(blocks, 82).unsqueeze(-1) * (packed >> 4).float().unsqueeze(-1)
    q = _two_bit_codes(blocks[:, 16:80]).float().view(-1, 16, 16)
    return (scale * q - minimum).view(-1, 256)


def _q3_k(blocks: Tensor) -> Tensor:
    # The high bit of element h*128 + j*32 + l is bit h*4 + j of hmask[l]; a clear bit subtracts 4.
    high = bit_planes(blocks[:, 0:32], 1, 8).reshape(-1, 256)
    q = _two_bit_codes(blocks[:, 32:96]).to(torch.int16) - ((high ^ 1).to(torch.int16) << 2)
    packed = blocks[:, 96:108]
    # Scale j: low four bits from the nibbles of bytes 0-7 (j < 8 low, else high), top two bits
    # from byte 8 + j % 4 at bit 2 * (j // 4).
    low = nibbles(packed[:, 0:8])
    top = bit_planes(packed[:, 8:12], 2, 4).reshape(-1, 16)
    scale = half(blocks, 108).unsqueeze(-1) * signed(low | (top << 4), 32).unsqueeze(-1)
    return (scale * q.float().view(-1, 16, 16)).view(-1, 256)


def _four_bit_codes(qs: Tensor) -> Tensor:
    """Q4_K / Q5_K low bits: sub-block 2c + s is nibble s (low, then high) of qs[c*32 : c*32 + 32]."""
    return bit_planes(qs.reshape(-1, 4, 32), 4, 2).reshape(-1, 8, 32)


def _q4_k(blocks: Tensor) -> Tensor:
    scales, mins = _scales_and_mins(blocks[:, 4:16])
    q = _four_bit_codes(blocks[:, 16:144]).float()
    return (half(blocks, 0).unsqueeze(-1) * scales * q - half(blocks, 2).unsqueeze(-1) * mins).view(-1, 256)


def _q5_k(blocks: Tensor) -> Tensor:
    scales, mins = _scales_and_mins(blocks[:, 4:16])
    high = bit_planes(blocks[:, 16:48], 1, 8)  # sub-block s takes bit s of qh[l]
    q = (_four_bit_codes(blocks[:, 48:176]) | (high << 4)).float()
    return (half(blocks, 0).unsqueeze(-1) * scales * q - half(blocks, 2).unsqueeze(-1) * mins).view(-1, 256)


def _q6_k(blocks: Tensor) -> Tensor:
    # Element h*128 + k*32 + l: low nibble k // 2 of ql[h*64 + (k % 2)*32 + l], top two bits
    # 2k..2k+1 of qh[h*32 + l]; scale index is element // 16.
    low = bit_planes(blocks[:, 0:128].reshape(-1, 2, 2, 32), 4, 2).transpose(2, 3).reshape(-1, 256)
    top = bit_planes(blocks[:, 128:192].reshape(-1, 2, 32), 2, 4).reshape(-1, 256)
    q = signed(low | (top << 4), 32).view(-1, 16, 16)
    scale = half(blocks, 208).unsqueeze(-1) * blocks[:, 192:208].contiguous().view(torch.int8).float().unsqueeze(-1)
    return (scale * q).view(-1, 256)


K_FORMATS = (
    QuantFormat("Q2_K", 10, 256, 84, _q2_k, (80, 82)),
    QuantFormat("Q3_K", 11, 256, 110, _q3_k, (108,)),
    QuantFormat("Q4_K", 12, 256, 144, _q4_k, (0, 2)),
    QuantFormat("Q5_K", 13, 256, 176, _q5_k, (0, 2)),
    QuantFormat("Q6_K", 14, 256, 210, _q6_k, (208,)),
)
