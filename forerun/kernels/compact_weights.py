"""Weights kept in a compact form beside an fp32 model: bf16, or a GGUF file's own quantized blocks.

A decode step with few rows is bound by reading weights, so the small-batch matmul
(forerun.kernels.gemv) reads these instead of the fp32 copy. Every compact weight is checked
to expand to exactly the fp32 weight the model holds, so the model's arithmetic does not change.
The GGUF converter saves the blocks and the loader reads them back (forerun.loader.gguf_blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# (compact form, fp32 weight) -> whether the form expands exactly to the weight
MatchFn = Callable[["CompactWeight", Tensor], bool]
# Format -> (code the C kernel knows, bytes per block of 32 weights; bf16 has no blocks).
FORMATS = {"bf16": (0, 64), "Q8_0": (1, 34), "Q4_0": (2, 18), "Q4_1": (3, 20)}


@dataclass(frozen=True)
class CompactWeight:
    """One [n, k] weight as `data`: uint8 [n, row_bytes], one weight row per line."""

    fmt: str
    data: Tensor
    k: int

    @property
    def code(self) -> int:
        return FORMATS[self.fmt][0]

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

    def matches(self, weight: Tensor) -> bool:
        """Whether this form expands to `weight`: exactly for fp32, and for a bf16 `weight` (a bf16
        engine's copy) after rounding the expansion to bf16."""
        if tuple(weight.shape) != (self.data.shape[0], self.k) or weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        return torch.equal(self.expand().to(weight.dtype), weight)

    @staticmethod
    def cat(parts: list[CompactWeight]) -> CompactWeight | None:
        """Parts stacked by rows (q/k/v or gate/up packed into one matmul); None if they differ in form."""
        if len({(p.fmt, p.k) for p in parts}) != 1:
            return None
        return CompactWeight(parts[0].fmt, torch.cat([p.data for p in parts]), parts[0].k)

    @staticmethod
    def random(fmt: str, n: int, k: int, gen: torch.Generator | None = None) -> CompactWeight:
        """A weight of realistic magnitude in `fmt`, for timing."""
        if fmt == "bf16":
            w = (torch.rand(n, k, generator=gen) - 0.5).mul_(0.1).to(torch.bfloat16)
            return CompactWeight(fmt, w.view(torch.uint8), k)
        size = FORMATS[fmt][1]
        data = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=gen)
        scale = torch.full((n, k // 32, 1), 0.01, dtype=torch.float16).view(torch.uint8)
        data[..., :2] = scale
        if fmt == "Q4_1":
            data[..., 2:4] = torch.full((n, k // 32, 1), -0.05, dtype=torch.float16).view(torch.uint8)
        return CompactWeight(fmt, data.view(n, -1), k)
