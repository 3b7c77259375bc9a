"""What every GGML storage format shares: the table entry and the bit-unpacking helpers.

Each helper works on a batch of blocks, uint8 [n, bytes], and keeps the block axis first, so a
format's decoder is a handful of whole-tensor operations with no Python loop over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# uint8 [n, block_bytes] -> float32 [n, block_size]
DecodeFn = Callable[[Tensor], Tensor]

# Rows are decoded this many elements at a time, so the temporaries stay a few MiB whatever the tensor.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class QuantFormat:
    """One GGML storage type. Invariant: a row of `cols` elements is `cols // block_size` blocks of
    `block_bytes` bytes each, stored back to back, and `decode` maps each block to its `block_size`
    float32 values with the same float operations, in the same order, as ggml's reference
    de-quantization, so results are bit-identical to it.

    `ggml_type` is the type's number in the GGUF file format (ggml's `enum ggml_type`);
    `scale_offsets` are the byte offsets of a block's fp16 scale fields (d, and dmin or m).
    """

    name: str
    ggml_type: int
    block_size: int
    block_bytes: int
    decode: DecodeFn
    scale_offsets: tuple[int, ...] = ()

    def row_bytes(self, cols: int) -> int:
        """Bytes one row of `cols` elements takes; ValueError when `cols` is not whole blocks."""
        if cols <= 0 or cols % self.block_size != 0:
            raise ValueError(f"cols: {cols} is not a positive multiple of {self.name}'s block size {self.block_size}")
        return cols // self.block_size * self.block_bytes

    def cols(self, row_bytes: int) -> int:
        """Elements in a row stored in `row_bytes` bytes; ValueError when that is not whole blocks."""
        if row_bytes <= 0 or row_bytes % self.block_bytes != 0:
            raise ValueError(
                f"row_bytes: {row_bytes} is not a positive multiple of {self.name}'s block bytes {self.block_bytes}")
        return row_bytes // self.block_bytes * self.block_size

    def dequantize(self, data: Tensor) -> Tensor:
        """uint8 [rows, row_bytes] (each line one row's blocks) -> float32 [rows, cols]."""
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError(f"data: expected a 2-D uint8 tensor of {self.name} blocks, "
                             f"got {data.dim()}-D {data.dtype}")
        rows, cols = data.shape[0], self.cols(data.shape[1])
        data = data.contiguous()
        out = torch.empty(rows, cols, dtype=torch.float32)
        step = max(1, _CHUNK_ELEMENTS // cols)
        for start in range(0, rows, step):
            part = data[start:start + step]
            blocks = part.reshape(-1, self.block_bytes)
            out[start:start + part.shape[0]] = self.decode(blocks).reshape(part.shape[0], cols)
        return out


    def random_blocks(self, rows: int, cols: int, scale: float, gen: torch.Generator | None = None) -> Tensor:
        """uint8 [rows, row_bytes] of random codes with every scale field `scale`: weights of a
        realistic magnitude, for timing (no NaN, infinity or subnormal slows a kernel)."""
        blocks = torch.randint(0, 256, (rows * (cols // self.block_size), self.block_bytes), dtype=torch.uint8,
                               generator=gen)
        field = torch.tensor([scale], dtype=torch.float16).view(torch.uint8)
        for offset in self.scale_offsets:
            blocks[:, offset:offset + 2] = field
        return blocks.view(rows, self.row_bytes(cols))


def half(blocks: Tensor, offset: int) -> Tensor:
    """The fp16 field at byte `offset` of every block, as float32 [n, 1] (fp16 -> fp32 is exact)."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., m] -> [..., 2m]: all low nibbles first, then all high nibbles (ggml's order)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def bit_planes(packed: Tensor, bits: int, planes: int) -> Tensor:
    """uint8 [..., m] -> [..., planes, m]: plane p holds bits [p*bits, (p+1)*bits) of every byte."""
    shifts = torch.arange(0, bits * planes, bits, dtype=torch.uint8).view(planes, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def little_endian_bits(packed: Tensor) -> Tensor:
    """uint8 [n, m] -> [n, 8m]: element i is bit i of the little-endian integer the bytes spell."""
    return bit_planes(packed, 1, 8).transpose(-1, -2).reshape(packed.shape[0], -1)


def signed(values: Tensor, offset: int) -> Tensor:
    """Small unsigned codes minus `offset`, as exact float32 (every such integer fits in fp32)."""
    return (values.to(torch.int16) - offset).float()
