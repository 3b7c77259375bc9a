"""Tensor- and pipeline-parallel placement that the model reads; no process state lives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group.

    Invariant: 0 <= rank < size. With size == 1 no method touches torch.distributed, so a
    single-process model never needs a process group. `group` is the process group of this rank's
    tensor-parallel peers; None means the default group (no pipeline stages: every rank is a peer).
    """

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; typed loosely so the dataclass stays hashable
    # True (batch-invariant mode): sums over ranks are added in rank order, element by element. A
    # collective's own all-reduce cuts the tensor into chunks by its size, so an element's order of
    # addition, and its last bits, could change with the number of rows in the step.
    ordered: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size: must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size}), got {self.rank}")

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over ranks in place and return it."""
        if self.size > 1 and self.ordered:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total += part
            x.copy_(total)
        elif self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: Tensor) -> Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's even share of `total`; `what` names the field when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what}: {total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size


@dataclass(frozen=True)
class PPStage:
    """This rank's pipeline stage: which contiguous layers it holds.

    Invariant: 0 <= start < end <= num_layers, so every stage holds at least one layer. The first stage
    also holds the embedding, the last the final norm and the LM head.
    """

    index: int = 0
    size: int = 1
    start: int = 0
    end: int = -1  # -1: up to the model's last layer (a single stage)

    @classmethod
    def split(cls, index: int, size: int, num_layers: int) -> "PPStage":
        """Stage `index` of `size` over `num_layers` layers; earlier stages take one more layer when they
        do not divide evenly (the last stage also runs the LM head)."""
        if size > num_layers:
            raise ValueError(f"pipeline_parallel_size: {size} stages for {num_layers} layers; "
                             "every stage needs at least one layer")
        base, extra = divmod(num_layers, size)
        start = index * base + min(index, extra)
        return cls(index, size, start, start + base + (1 if index < extra else 0))

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end < 0 else self.end)
