"""CPU tensors copied into one private memory map that asks for transparent huge pages (2 MiB).

Why: at one request a decode step streams every weight from DRAM. With 4 KiB pages each 4 KiB of
weights costs a TLB miss, and on a virtual machine a miss is a two-level page walk; the hardware
prefetchers also stop at every 4 KiB boundary. Reading 600 MB of blocks (8192 x 2048 matrices, two
threads, Intel Xeon VM, interleaved runs, median) the block GEMV streamed Q4_1 at 7.9 GB/s from
small pages and 11.9 GB/s from huge pages; Q8_0 11.8 against 15.8, Q4_K 7.1 against 9.7.

The map is private and anonymous (a shared one is shmem, whose huge pages Linux configures apart
and often leaves off), starts on a 2 MiB boundary, and holds the tensors back to back on 64-byte
boundaries, so it costs at most one partly used huge page over the tensors' own bytes. Where the OS
has no transparent huge pages the same map simply keeps small pages.
"""

from __future__ import annotations

import mmap

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: each tensor starts on one, as torch's own allocations do


class HugePageArena:
    """`nbytes` of memory, for tensors copied in one at a time (`copy`) until it is full.

    Invariant: the map lives as long as any copy does (each copy is a view of it)."""

    def __init__(self, nbytes: int) -> None:
        pages = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
            try:
                pages.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel built without transparent huge pages: small pages, as before
                pass
        self._arena = torch.frombuffer(pages, dtype=torch.uint8)
        self._next = -self._arena.data_ptr() % HUGE_PAGE  # the pages before it are never made resident
        self._end = self._next + nbytes

    def copy(self, t: Tensor) -> Tensor:
        """A contiguous copy of CPU tensor `t` in the arena; ValueError when it does not fit."""
        size = t.numel() * t.element_size()
        if self._next + size > self._end:
            raise ValueError(f"t: {size} bytes do not fit in the {self._end - self._next} bytes left")
        view = self._arena[self._next:self._next + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._next += -(-size // ALIGN) * ALIGN
        return view

    @staticmethod
    def room_for(nbytes: list[int]) -> int:
        """The arena size that holds tensors of these sizes, each on its own 64-byte boundary."""
        return sum(-(-n // ALIGN) * ALIGN for n in nbytes)
