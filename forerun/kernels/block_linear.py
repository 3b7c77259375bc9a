"""Matmuls over weights held only as a GGUF file's blocks: which kernel runs each row count.

Few rows are bound by reading the weights: a GEMV reads the blocks as stored (forerun.kernels.
kquant_gemv, every GGML format forerun reads). Many rows are bound by arithmetic: a matmul expands a
tile of blocks at a time in cache and multiplies every row by it (forerun.kernels.block_matmul; in
batch-invariant mode forerun.kernels.lane_matmul, in the GEMV's own order of sums); where no C kernel
reads a format the weight is expanded per call (correct, slow). Each part of a packed weight in its own
format (q/k/v of a K-quant mix) runs on its own and the outputs are joined.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from forerun.kernels.block_matmul import BlockMatmul, OrderedGemv, vectorised
from forerun.kernels.build import profiled
from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.gemv import CompactLinear
from forerun.kernels.kquant_gemv import KQuantGemv, supports
from forerun.kernels.lane_matmul import LaneMatmul
from forerun.kernels.types import LinearFn


@dataclass(frozen=True)
class BlockGemvLinear:
    """x -> x W^T + b over one weight's GGUF blocks as stored, on a GEMV: the block GEMV, or in
    batch-invariant mode the one that sums in the block matmul's order; its fields are what the fused
    decode step (forerun.kernels.decode) hands to C."""

    gemv: KQuantGemv | OrderedGemv
    bias: Tensor | None  # fp32, contiguous
    fp32_out: bool = False  # True: fp32 output whatever the input's dtype (logits)

    @property
    def k(self) -> int:
        return self.gemv.k

    @property
    def n(self) -> int:
        return self.gemv.n

    def __call__(self, x: Tensor) -> Tensor:
        y = self.gemv(x, self.fp32_out)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


@dataclass(frozen=True)
class JoinedGemv:
    """x -> x W^T + b for a weight packed from parts in different formats (q/k/v or gate/up of a
    K-quant mix), each part on its own block GEMV and the outputs side by side; the fused decode
    step (forerun.kernels.decode) runs the parts into one output buffer the same way."""

    parts: tuple[BlockGemvLinear, ...]  # without bias; each part's rows in order
    bias: Tensor | None  # fp32, contiguous, over all parts' outputs

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    def __call__(self, x: Tensor) -> Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


Small = CompactLinear | BlockGemvLinear | JoinedGemv


def small_block_linear(lib: ctypes.CDLL | None, weight: CompactWeight, bias: Tensor | None,
                       fp32_out: bool, activation_bits: int = 32) -> BlockGemvLinear | None:
    """The GEMV for few rows over `weight`'s blocks as stored, or None where no kernel reads its format;
    `activation_bits` 16 or 8: over integer activations where the format has that GEMV."""
    gemv = KQuantGemv.create(lib, weight.data, weight.fmt, weight.k, activation_bits)
    if gemv is None:
        return None
    return BlockGemvLinear(gemv, None if bias is None else bias.detach().float().contiguous(), fp32_out)


def large_block_linear(lib: ctypes.CDLL | None, weight: CompactWeight, dtype: torch.dtype,
                       fp32_out: bool = False, gemv_order: bool = False) -> LinearFn:
    """The matmul for many rows over `weight`'s blocks, for inputs in `dtype` (fp32 out with
    `fp32_out`): the block matmul (its bf16 variant only where the CPU has AVX512_BF16; elsewhere bf16
    is emulated and the fp32 variant runs), or with `gemv_order`, and on CPUs without AVX2, the lane
    matmul, which sums in fp32 exactly as the block GEMV does (a row's result then does not depend on
    the row count); without the C kernels the weight expanded per call."""
    mm = BlockMatmul.create(lib, weight.data, weight.fmt, weight.k)
    lanes = LaneMatmul.create(lib, weight.data, weight.fmt, weight.k)
    if mm is None or lanes is None:
        run = expanding_linear([weight], None, dtype)
        return (lambda x: run(x).float()) if fp32_out else run
    assert lib is not None
    # Without a vector path the block matmul is the portable loop, and the lane matmul's is several
    # times faster in either dtype.
    if gemv_order or not vectorised(lib, torch.float32):
        return lambda x: lanes(x, fp32_out)
    if dtype == torch.bfloat16 and not vectorised(lib, torch.bfloat16):
        return lambda x: mm(x.float()) if fp32_out else mm(x.float()).to(x.dtype)
    return lambda x: mm(x, fp32_out)


def ordered_block_linear(lib: ctypes.CDLL | None, weight: CompactWeight, bias: Tensor | None,
                         fp32_out: bool = False) -> BlockGemvLinear | None:
    """The GEMV for few rows over `weight`'s blocks that sums in the block matmul's order
    (forerun.kernels.block_matmul.OrderedGemv), or None where it cannot run."""
    if lib is None or not hasattr(lib, "gemv_ordered_f32") or not supports(weight.fmt, weight.k):
        return None
    return BlockGemvLinear(OrderedGemv(lib, weight.data, weight.fmt, weight.k),
                         None if bias is None else bias.detach().float().contiguous(), fp32_out)


def expanding_linear(blocks: Sequence[CompactWeight], bias: Tensor | None, dtype: torch.dtype) -> LinearFn:
    """x -> x W^T + b that expands the blocks at every call: the fallback where no kernel reads them
    (no C library, or a format no kernel knows). Correct and slow: nothing dense is kept."""
    def run(x: Tensor) -> Tensor:
        with profiled("forerun::linear_expand"):
            w = CompactWeight.expand_stacked(list(blocks), dtype)
            return F.linear(x, w, bias)
    return run


def joined(parts: Sequence[LinearFn], bias: Tensor | None) -> LinearFn:
    """The matmul of a weight stacked from parts (rows in order), each part's output side by side."""
    if len(parts) == 1 and bias is None:
        return parts[0]

    def run(x: Tensor) -> Tensor:
        y = torch.cat([p(x) for p in parts], dim=-1) if len(parts) > 1 else parts[0](x)
        return y if bias is None else y + bias.to(y.dtype)
    return run
