"""Ways to run y = x W^T + b on the CPU, chosen per machine by measurement (see forerun.kernels.probe).

`aten` is plain `F.linear`. `mkldnn` prepacks the weight once into the blocked layout oneDNN's GEMM
wants (what inductor's `freezing` does), which saves the per-call reorder: on some CPUs that is worth
2x on wide matrices such as the LM head, on others nothing. `native` is forerun's own fp32 GEMM over
a packed weight (forerun.kernels.gemm), available when the C kernels built. (MKL's packed GEMM
is left out: it only helps at the exact batch size it was packed for.) `available_kernels` says which
kernels this torch build, CPU and dtype can use. A model asks a `LinearPlan` for each of its matmuls
and never names a kernel itself.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from forerun.kernels.block_linear import (JoinedGemv, Small, joined, large_block_linear, ordered_block_linear,
                                         small_block_linear)
from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.gemm import PackedGemm
from forerun.kernels.gemv import CompactGemv
from forerun.kernels.types import LinearFn

KERNELS = ("aten", "mkldnn", "native")


def available_kernels(dtype: torch.dtype, device: torch.device, gemm: PackedGemm | None = None) -> list[str]:
    """Kernels that run on this device and dtype in this torch build (always includes 'aten');
    'native' needs forerun's built C kernels (`gemm`) and fp32."""
    if device.type != "cpu":
        return ["aten"]
    found = ["aten"]
    w = torch.zeros(8, 8, dtype=dtype)
    for name in KERNELS[1:]:
        if name == "native" and (gemm is None or dtype != torch.float32):
            continue
        try:
            make_linear(w, None, name, 4, gemm)(torch.zeros(2, 8, dtype=dtype))
            found.append(name)
        except (RuntimeError, AttributeError, NotImplementedError):
            continue  # this build or CPU lacks it (e.g. bf16 oneDNN needs avx512bw or avx_ne_convert)
    return found


def make_linear(weight: Tensor, bias: Tensor | None, kernel: str, batch_hint: int,
                gemm: PackedGemm | None = None) -> LinearFn:
    """A function x -> x W^T + b using `kernel`; the prepacked weight lives in its closure."""
    if kernel == "aten":
        return lambda x: F.linear(x, weight, bias)
    if kernel == "mkldnn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        op = torch.ops.mkldnn._linear_pointwise

        def run(y: Tensor) -> Tensor:
            return op(y, packed, bias, "none", [], "")
        return lambda x: in_row_buckets(run, x)
    if kernel == "native":
        if gemm is None:
            raise ValueError("linear_kernel: 'native' needs forerun's C kernels (native_kernels on, a C compiler)")
        return gemm.linear(weight, bias)
    raise ValueError(f"linear_kernel: unknown kernel {kernel!r}; expected one of {KERNELS}")


def row_bucket(rows: int) -> int:
    """The row count a oneDNN matmul runs at: `rows` up to 16, above that rounded up to one of 8 steps
    an octave (at most an eighth more rows).

    Why: oneDNN compiles a kernel for every shape it meets, row count included, and keeps the last
    1,024. A new row count cost 1.5-2 ms where the matmul itself took 0.13-0.25 (bf16, 576 x 1536,
    Intel Xeon avx512_bf16), and one weight's row counts 1-1,300 taken in turn missed every time
    (7.3 s against 1.3 s in buckets). An engine's steps take every row count up to its token budget;
    in buckets each weight shape sees at most about 100 of them."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def in_row_buckets(matmul: LinearFn, x: Tensor) -> Tensor:
    """`matmul(x)` run at row_bucket of x's row count: zero rows added, their outputs dropped."""
    rows = x.shape[0]
    padded = row_bucket(rows)
    if x.dim() != 2 or padded == rows:
        return matmul(x)
    return matmul(F.pad(x, (0, 0, 0, padded - rows)))[:rows]


def split_by_rows(small: LinearFn, large: LinearFn, max_rows: int) -> LinearFn:
    """`small` for inputs of at most `max_rows` rows (memory-bound), `large` above (compute-bound)."""
    return lambda x: small(x) if x.shape[0] <= max_rows else large(x)


@dataclass(frozen=True)
class BuiltLinear:
    """One weight's matmul as a `LinearPlan` built it.

    Invariant: `matmul` None means plain `F.linear` over the dense weight; `small` is the compact-weight
    matmul `matmul` uses for inputs of at most the plan's `small_rows` rows (None: none); `reads_dense`
    says whether `matmul` still reads the dense weight (when False the caller may free it).
    """

    matmul: LinearFn | None
    small: Small | None
    reads_dense: bool


@dataclass(frozen=True)
class LinearPlan:
    """How every matmul of one model runs: `kernel` (`gemm` runs 'native') for all inputs, prepacked
    for `batch_hint` rows, and `gemv` over a compact form of the weight for inputs of at most
    `gemv_rows` rows, where the weight has one the kernel reads exactly. A weight held as GGUF blocks
    (`build_blocks`) reads them through `lib`'s block kernels; `dense_copy` lets its inputs of more
    than `gemv_rows` rows read a dense copy in the model's dtype instead (more memory, the fastest
    batched matmuls where the block matmul is slower)."""

    kernel: str = "aten"
    batch_hint: int = 1
    gemv: CompactGemv | None = None
    gemv_rows: int = 0
    gemm: PackedGemm | None = None
    lib: ctypes.CDLL | None = None
    dense_copy: bool = False
    ordered_rows: int = 0  # batch-invariant bf16: GGUF blocks of inputs up to this many rows on the ordered GEMV
    # GGUF blocks' GEMV: 32 multiplies fp32 inputs; 16 or 8 rounds them to integers per 32 (INT_FORMATS).
    activation_bits: int = 32
    # Batch-invariant mode: dense matrices run `kernel` alone (fp32 'native': one order at every row count);
    # GGUF blocks keep their GEMV, whose order the lane matmul shares (bf16: the ordered pair instead).
    invariant: bool = False

    @property
    def small_rows(self) -> int:
        """Inputs of at most this many rows run a layer's `small` matmul (where it has one)."""
        return self.ordered_rows if self.ordered_rows > 0 else self.gemv_rows

    def build(self, weight: Tensor, bias: Tensor | None, compact: CompactWeight | None,
              fp32_out: bool = False) -> BuiltLinear:
        """The matmul x -> x W^T + b for this plan; `compact` is the checkpoint's own compact form of
        `weight` (GGUF blocks), else bf16 is tried where it holds the weight exactly. `fp32_out`: the
        compact matmul returns fp32 for bf16 inputs (the LM head, whose logits are used as fp32)."""
        if self.invariant and weight.dtype != torch.float32:
            raise ValueError(f"batch_invariant: a dense {weight.dtype} matrix {tuple(weight.shape)} has no "
                             "batch-invariant kernel (only GGUF blocks do in bf16); use dtype float32")
        large = None if self.kernel == "aten" else make_linear(weight, bias, self.kernel, self.batch_hint, self.gemm)
        small = None
        if self.gemv is not None and self.gemv_rows > 0 and not self.invariant:
            small = self.gemv.linear(compact or CompactWeight.bf16_of(weight), bias, fp32_out)
        if small is not None:
            matmul = split_by_rows(small, large or (lambda x: F.linear(x, weight, bias)), self.gemv_rows)
        else:
            matmul = large
        return BuiltLinear(matmul, small, reads_dense=large is None)

    def build_blocks(self, blocks: Sequence[CompactWeight], bias: Tensor | None, dtype: torch.dtype,
                     fp32_out: bool = False) -> BuiltLinear:
        """The matmul x -> x W^T + b of a weight held as GGUF blocks (one entry per part in its own
        format, rows in order), in `dtype`; `small` is set where one GEMV reads the whole weight."""
        if self.dense_copy:
            weight = CompactWeight.expand_stacked(list(blocks), dtype)
            large = make_linear(weight, bias, self.kernel, self.batch_hint, self.gemm)
        else:
            # Invariant fp32: the lane matmul, whose sums are the block GEMV's (bf16: the ordered pair).
            gemv_order = self.invariant and self.ordered_rows == 0
            large = joined([large_block_linear(self.lib, b, dtype, fp32_out, gemv_order) for b in blocks], bias)
        # Batch-invariant bf16: at few rows the GEMV that sums in the bf16 block matmul's own order.
        make_small, rows = ((ordered_block_linear, self.ordered_rows) if self.ordered_rows > 0
                            else (functools.partial(small_block_linear, activation_bits=self.activation_bits),
                                  self.gemv_rows))
        if rows <= 0:
            return BuiltLinear(large, None, reads_dense=False)
        if len(blocks) == 1:
            small = make_small(self.lib, blocks[0], bias, fp32_out)
            if small is None:
                return BuiltLinear(large, None, reads_dense=False)
            return BuiltLinear(split_by_rows(small, large, rows), small, reads_dense=False)
        smalls = [make_small(self.lib, b, None, fp32_out) for b in blocks]
        if any(s is None for s in smalls):
            return BuiltLinear(large, None, reads_dense=False)
        small_parts = JoinedGemv(tuple(s for s in smalls if s is not None),  # type: ignore[arg-type]
                                 None if bias is None else bias.detach().float().contiguous())
        return BuiltLinear(split_by_rows(small_parts, large, rows), small_parts, reads_dense=False)
