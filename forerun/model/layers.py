"""Building blocks of the Llama family: RMSNorm, tensor-parallel linears and embeddings.

Parameters are created with `torch.empty` (no random init): every one is overwritten by
`load_weights`, and skipping init keeps model construction cheap.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.huge_pages import HugePageArena
from forerun.kernels.linear import LinearPlan, Small
from forerun.kernels.ops import NativeOps
from forerun.kernels.types import LinearFn
from forerun.model.parallel import TPGroup

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim; `weight` has shape [hidden].

    With `native` set (forerun.kernels.ops) the add and the norm run as one fused C pass
    wherever it accepts the input, and as torch ops elsewhere.
    """

    native: NativeOps | None = None

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.shape = (hidden,)
        self.weight = nn.Parameter(torch.empty(hidden))

    def forward(self, x: Tensor) -> Tensor:
        if self.native is not None:
            fused = self.native.add_rms_norm(x, None, self.weight, self.eps)
            if fused is not None:
                return fused[0]
        return F.rms_norm(x, self.shape, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """Residual add then norm: returns (norm(x + residual), x + residual)."""
        if self.native is not None:
            fused = self.native.add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        residual = x + residual
        return F.rms_norm(residual, self.shape, self.weight, self.eps), residual


class PackableLinear(nn.Module):
    """A linear layer whose matmul can be switched to a prepacked kernel once its weights are loaded.

    Its weight is either dense (`weight`) or a GGUF file's blocks (`blocks`: one CompactWeight per
    packed part, rows in order; `weight` is then empty). Invariant: until `use_kernel` is called,
    `matmul` is plain `F.linear` over the dense weight (over the blocks expanded, for a block layer);
    afterwards it uses what the kernels' `LinearPlan` built from the loaded weight (so weights must be
    loaded first): a prepacked copy, and for small inputs a compact one that expands exactly to the weight.
    """

    weight: nn.Parameter
    blocks: list[CompactWeight] | None = None  # the weight as a GGUF file stores it, one entry per part
    small: Small | None = None  # the matmul of inputs of at most `small_rows` rows, when set
    small_rows: int = 0
    _matmul: LinearFn | None = None
    dense_shape: tuple[int, ...] | None = None  # the weight's shape once `use_kernel` freed it (updates refill it)

    def set_blocks(self, blocks: list[CompactWeight]) -> None:
        """Hold the weight as `blocks` (this rank's rows, parts in order) and free the dense one."""
        self.blocks = blocks
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def dense_weight(self) -> Tensor:
        """The weight as a dense tensor: `weight`, or the blocks expanded in the model's dtype."""
        if self.blocks is None:
            return self.weight.detach()
        dtype = self.weight.dtype
        return CompactWeight.expand_stacked(self.blocks, dtype)

    def use_kernel(self, plan: LinearPlan, with_bias: bool = True, keep_weight: bool = True,
                   fp32_out: bool = False) -> bool:
        """Run this matmul as `plan` builds it from now on (small inputs over a compact form of this
        weight: its blocks, else bf16 where that is exact); answers whether small inputs read a compact
        form. Without `keep_weight` a packed layer frees its dense weight (the packed copy is all it
        reads). `fp32_out`: small inputs give fp32 outputs in a bf16 model (see LinearPlan.build)."""
        bias = getattr(self, "bias", None) if with_bias else None
        if self.blocks is not None:
            built = plan.build_blocks(self.blocks, bias, self.weight.dtype, fp32_out)
        else:
            built = plan.build(self.weight.detach(), bias, None, fp32_out)
        self.small, self.small_rows = built.small, plan.small_rows if built.small is not None else 0
        self._matmul = built.matmul
        if not built.reads_dense and not keep_weight and self.blocks is None:
            self.dense_shape = tuple(self.weight.shape)
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return built.small is not None

    def matmul(self, x: Tensor, with_bias: bool = True) -> Tensor:
        if self._matmul is not None:
            return self._matmul(x)
        return F.linear(x, self.dense_weight(), getattr(self, "bias", None) if with_bias else None)


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W split by output rows: this rank holds rows [rank*n, (rank+1)*n)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.out_per_rank = tp.shard(out_features, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x)

    def load_weight(self, param: str, full: Tensor | CompactWeight) -> None:
        """Copy this rank's rows of a full (unsharded) `weight` or `bias`; blocks are kept as blocks."""
        start = self.tp.rank * self.out_per_rank
        if isinstance(full, CompactWeight):
            self.set_blocks([full.narrow_rows(start, self.out_per_rank)])
            return
        getattr(self, param).data.copy_(full.narrow(0, start, self.out_per_rank))


class MergedColumnParallelLinear(PackableLinear):
    """Several column-parallel outputs packed into one matmul (q/k/v, or gate/up).

    Invariant: each rank's output is the concatenation, in order, of its share of each part, so
    the caller splits it with `self.sizes` (the per-rank sizes).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.sizes = [tp.shard(n, f"output_sizes[{i}]") for i, n in enumerate(output_sizes)]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        total = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.empty(total)) if bias else None
        self._parts: dict[int, CompactWeight] = {}  # parts that came as blocks, until all have
        self._dense_parts: set[int] = set()  # parts that came as dense tensors

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x)

    def load_weight(self, param: str, full: Tensor | CompactWeight, part: int) -> None:
        """Copy this rank's share of part `part` (e.g. 1 = k of q/k/v) from its full tensor. The layer
        holds blocks once every part came as blocks; where some part came dense, the parts that came as
        blocks are expanded into the dense weight instead."""
        n = self.sizes[part]
        if full.shape[0] != n * self.tp.size:
            raise ValueError(f"{param}: part {part} has {full.shape[0]} rows, expected {n * self.tp.size}")
        if isinstance(full, CompactWeight):
            self._parts[part] = full.narrow_rows(self.tp.rank * n, n)
            if not self._dense_parts and len(self._parts) == len(self.sizes):
                self.set_blocks(_merge([self._parts[i] for i in range(len(self.sizes))]))
                self._parts.clear()  # merged parts are copies: holding the originals too doubles them
        else:
            target = getattr(self, param)
            target.data.narrow(0, self.offsets[part], n).copy_(full.narrow(0, self.tp.rank * n, n))
            if param == "weight":
                self._dense_parts.add(part)
        if self._dense_parts:  # a mix: this layer is dense, every part that came as blocks expanded into it
            for i, blocks in self._parts.items():
                self.weight.data.narrow(0, self.offsets[i], self.sizes[i]).copy_(blocks.expand())
            self._parts.clear()


class RowParallelLinear(PackableLinear):
    """y = all_reduce(x_shard W_shard^T) + b with W split by input columns; the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_per_rank = tp.shard(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def use_kernel(self, plan: LinearPlan, with_bias: bool = True, keep_weight: bool = True,
                   fp32_out: bool = False) -> bool:
        # With several ranks the bias is added once, after the all-reduce.
        return super().use_kernel(plan, with_bias=self.tp.size == 1, keep_weight=keep_weight, fp32_out=fp32_out)

    def forward(self, x: Tensor) -> Tensor:
        if self.tp.size == 1:
            return self.matmul(x)
        y = self.tp.all_reduce(self.matmul(x, with_bias=False))
        return y if self.bias is None else y + self.bias

    def load_weight(self, param: str, full: Tensor | CompactWeight) -> None:
        """Copy this rank's input columns of `weight`, or the whole `bias`. Blocks stay blocks where this
        rank's columns are whole blocks; where a shard boundary would cut a block, this rank's columns
        are expanded to a dense weight (logged)."""
        target = getattr(self, param)
        start = self.tp.rank * self.in_per_rank
        if isinstance(full, CompactWeight):
            mine = full.narrow_cols(start, self.in_per_rank) if self.tp.size > 1 else full
            if mine is not None:
                self.set_blocks([mine])
                return
            logger.info("a %d-column shard cuts %s's %d-weight blocks: that shard is held dense",
                        self.in_per_rank, full.fmt, full.block_size)
            full = full.expand()
        if param == "bias":
            target.data.copy_(full)
        else:
            target.data.copy_(full.narrow(1, start, self.in_per_rank))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; the vocab is padded up to a multiple of tp size.

    Invariant: this rank holds ids [start, start + rows); padded rows are zero and never looked up.
    """

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden))

    table: CompactWeight | None = None  # the table as a GGUF file's blocks (`weight` is then empty)

    def _lookup(self, ids: Tensor) -> Tensor:
        if self.table is None:
            return F.embedding(ids, self.weight)
        rows = CompactWeight(self.table.fmt, self.table.data.index_select(0, ids.reshape(-1)), self.table.k)
        return rows.expand().to(self.weight.dtype).view(*ids.shape, self.table.k)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def load_weight(self, param: str, full: Tensor | CompactWeight) -> None:
        """Copy this rank's rows of the full [vocab, hidden] table (zeros past the real vocab); blocks
        stay blocks (zero bytes are zero weights in every GGML format)."""
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"{param}: has {full.shape[0]} rows, expected vocab_size {self.vocab_size}")
        n = max(0, min(self.rows, self.vocab_size - self.start))
        if isinstance(full, CompactWeight):
            data = torch.zeros(self.rows, full.data.shape[1], dtype=torch.uint8)
            data[:n] = full.data[self.start:self.start + n]
            self.table = CompactWeight(full.fmt, data, full.k)
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
            return
        self.weight.data.zero_()
        self.weight.data.narrow(0, 0, n).copy_(full.narrow(0, self.start, n))


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Output projection sharing the embedding's sharding; logits are gathered to the full vocab."""

    def forward(self, hidden: Tensor) -> Tensor:  # type: ignore[override]
        logits = self.tp.all_gather_last_dim(self.matmul(hidden, with_bias=False))
        return logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits


def _merge(parts: list[CompactWeight]) -> list[CompactWeight]:
    """Adjacent parts in one format stacked into one weight: fewer, larger matmuls."""
    merged = [parts[0]]
    for part in parts[1:]:
        joined = CompactWeight.cat([merged[-1], part])
        merged[-1:] = [joined] if joined is not None else [merged[-1], part]
    return merged


RELEASE_EVERY = 64 << 20  # bytes of blocks moved between two calls of `release`


def place_blocks_on_huge_pages(model: nn.Module, release: Callable[[], None] = lambda: None) -> int:
    """Move every GGUF block matrix `model` holds (linear layers' blocks, embedding tables) into one
    memory map of huge pages (forerun.kernels.huge_pages: the decode GEMVs stream them faster), each
    original dropped as soon as it is copied; returns the bytes moved. `release` is called after every
    RELEASE_EVERY bytes moved, to hand the dropped originals' memory back (they sit in malloc's heap
    until trimmed): without it the model's blocks were resident twice at the end of the move (1B-shape
    Q4_K_M: a peak of 1,585 MB against 950 once loaded). Call before the kernels are built, since they
    keep pointers to the blocks."""
    holders = [m for m in model.modules() if isinstance(m, (PackableLinear, VocabParallelEmbedding))]
    sizes: dict[int, int] = {}
    for m in holders:
        for w in _held_blocks(m):
            sizes[id(w)] = w.data.numel() * w.data.element_size()
    if not sizes:
        return 0
    arena = HugePageArena(HugePageArena.room_for(list(sizes.values())))
    moved: dict[int, CompactWeight] = {}  # keys: originals, alive until their last holder lets go

    def move(w: CompactWeight) -> CompactWeight:
        if id(w) not in moved:
            moved[id(w)] = CompactWeight(w.fmt, arena.copy(w.data), w.k)
        return moved[id(w)]

    unreleased = 0
    for m in holders:
        unreleased += sum(sizes[id(w)] for w in _held_blocks(m))
        if isinstance(m, PackableLinear) and m.blocks:
            m.blocks = [move(w) for w in m.blocks]
        if isinstance(m, VocabParallelEmbedding) and m.table is not None:
            m.table = move(m.table)
        if unreleased >= RELEASE_EVERY:
            release()
            unreleased = 0
    return sum(sizes.values())


def _held_blocks(module: nn.Module) -> list[CompactWeight]:
    held = list(module.blocks or []) if isinstance(module, PackableLinear) else []
    if isinstance(module, VocabParallelEmbedding) and module.table is not None:
        held.append(module.table)
    return held
