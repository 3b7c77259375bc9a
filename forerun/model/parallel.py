"""Tensor-parallel group info that the parallel layers read; no process state lives here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group.

    Invariant: 0 <= rank < size. With size == 1 no method touches torch.distributed, so a
    single-process model never needs a process group.
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size: must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size}), got {self.rank}")

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over ranks in place and return it."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: Tensor) -> Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's even share of `total`; `what` names the field when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what}: {total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size
