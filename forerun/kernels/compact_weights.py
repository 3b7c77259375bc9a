"""Weights in a compact form: bf16, or a GGUF file's own quantized blocks in any GGML format.

A decode step with few rows is bound by reading weights, so the small-batch matmuls
(forerun.kernels.gemv, forerun.kernels.kquant_gemv) read these instead of a dense copy. A GGUF
model keeps only these (forerun.loader.gguf_weights); a dense model may get a bf16 form where that
holds its fp32 weight exactly, so the model's arithmetic does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from forerun.kernels.formats import QUANT_FORMATS

# Format -> (code the compact GEMV kernel knows, bytes per block of 32 weights; bf16 has no blocks).
FORMATS = {"bf16": (0, 64), "Q8_0": (1, 34), "Q4_0": (2, 18), "Q4_1": (3, 20)}


def block_size(fmt: str) -> int:
    """Weights per block along k of format `fmt` ("bf16" or a GGML type name; 1 for bf16)."""
    return 1 if fmt == "bf16" else QUANT_FORMATS[fmt].block_size


@dataclass(frozen=True)
class CompactWeight:
    """One [n, k] weight as `data`: uint8 [n, row_bytes], one weight row per line, in `fmt`: "bf16"
    or a GGML type name (forerun.kernels.formats.QUANT_FORMATS, e.g. "Q4_K")."""

    fmt: str
    data: Tensor
    k: int

    @property
    def code(self) -> int:
        """The compact GEMV's format code (only for the formats in FORMATS)."""
        return FORMATS[self.fmt][0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)

    @property
    def block_size(self) -> int:
        """Weights per block along k (1 for bf16): a slice of k must start and end on one."""
        return block_size(self.fmt)

    def narrow_rows(self, start: int, length: int) -> CompactWeight:
        """Weight rows [start, start + length) (a view)."""
        return CompactWeight(self.fmt, self.data.narrow(0, start, length), self.k)

    def narrow_cols(self, start: int, length: int) -> CompactWeight | None:
        """Input columns [start, start + length) as a copy, or None where that would cut a block."""
        size = self.block_size
        if start % size or length % size:
            return None
        per = self.data.shape[1] // (self.k // size)  # bytes per block (2 for bf16's one weight)
        return CompactWeight(self.fmt, self.data[:, start // size * per:(start + length) // size * per].contiguous(),
                             length)

    @staticmethod
    def bf16_of(weight: Tensor) -> CompactWeight | None:
        """The bf16 form of an fp32 (or bf16) weight, or None when bf16 cannot hold it exactly."""
        if weight.dim() != 2:
            return None
        if weight.dtype == torch.bfloat16:
            return CompactWeight("bf16", weight.detach().contiguous().view(torch.uint8), weight.shape[1])
        if weight.dtype != torch.float32:
            return None
        half = weight.detach().to(torch.bfloat16)
        if not torch.equal(half.float(), weight):
            return None
        return CompactWeight("bf16", half.view(torch.uint8), weight.shape[1])

    def expand(self) -> Tensor:
        """The fp32 weight, computed as GGUF's reference de-quantization computes it."""
        if self.fmt == "bf16":
            return self.data.view(torch.bfloat16).float()
        if self.fmt not in FORMATS:
            return QUANT_FORMATS[self.fmt].dequantize(self.data)
        n = self.data.shape[0]
        blocks = self.data.view(n, -1, FORMATS[self.fmt][1])
        d = blocks[..., :2].contiguous().view(torch.float16).float()
        if self.fmt == "Q8_0":
            return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).view(n, -1)
        qs = blocks[..., 4:] if self.fmt == "Q4_1" else blocks[..., 2:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # low nibbles are elements 0-15
        if self.fmt == "Q4_1":
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            return (d * q + m).view(n, -1)
        return ((q - 8) * d).view(n, -1)

    @staticmethod
    def expand_stacked(parts: list[CompactWeight], dtype: torch.dtype) -> Tensor:
        """Parts stacked by rows (each in its own format), expanded to one dense weight in `dtype`."""
        return torch.cat([p.expand() for p in parts]).to(dtype)

    @staticmethod
    def cat(parts: list[CompactWeight]) -> CompactWeight | None:
        """Parts stacked by rows (q/k/v or gate/up packed into one matmul); None if they differ in form."""
        if len({(p.fmt, p.k) for p in parts}) != 1:
            return None
        # numpy: torch.cat of uint8 rows runs a slow generic path (30x slower measured here).
        return CompactWeight(parts[0].fmt, torch.from_numpy(np.concatenate([p.data.numpy() for p in parts])),
                             parts[0].k)

    @staticmethod
    def random(fmt: str, n: int, k: int, gen: torch.Generator | None = None) -> CompactWeight:
        """A weight of realistic magnitude in `fmt`, for timing."""
        if fmt == "bf16":
            w = (torch.rand(n, k, generator=gen) - 0.5).mul_(0.1).to(torch.bfloat16)
            return CompactWeight(fmt, w.view(torch.uint8), k)
        return CompactWeight(fmt, QUANT_FORMATS[fmt].random_blocks(n, k, 0.01, gen), k)
