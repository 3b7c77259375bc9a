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

import ctypes
import ctypes.util
import gc
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


# glibc's mallopt parameters, and the thresholds forerun fixes (see fix_heap_thresholds).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAP_THRESHOLD = 32 << 20
LOAD_TRIM, STEP_TRIM = 8 << 20, 64 << 20


def libc() -> ctypes.CDLL:
    """The C library, with errno kept for ctypes.get_errno (where none is found by name, the
    process's own symbols, which hold the C library's)."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def return_free_heap() -> None:
    """Hand malloc's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). Freed blocks
    below malloc's map threshold stay in its heap and count as resident: after the blocks moved into
    the arena, `forerun serve` on SmolLM2 Q4_1 held 46 MB more resident without this."""
    gc.collect()
    c = libc()
    if hasattr(c, "malloc_trim"):
        c.malloc_trim(0)


def fix_heap_thresholds(trim: int = LOAD_TRIM) -> None:
    """Fix glibc's map threshold at MAP_THRESHOLD and its trim threshold at `trim` (elsewhere
    nothing): LOAD_TRIM before loading, STEP_TRIM once the engine is built.

    Why: glibc raises both thresholds with every large block freed (the trim threshold to 64 MiB), and
    a malloc arena then keeps a free top of up to that size resident. The weights' first copies, freed
    after their move to huge pages, stayed resident or not with where the last live allocation
    happened to sit: SmolLM2 Q4_1 kept 27 MB more after load (394 against 366 MB) after a change to the
    C kernels alone. While loading, a free top over 8 MiB goes back at the next free. Once serving,
    the opposite: a step's temporaries (64 rows of SmolLM2's logits are 12.6 MB) are freed and taken
    again every step, and each time they went back they came again as page faults (about 9,000 a step
    at 64 requests, most in the block matmul's stores), so a top of up to 64 MiB is kept. Blocks under
    32 MiB come from the heap throughout, not from maps of their own."""
    c = libc()
    if hasattr(c, "mallopt"):
        c.mallopt(M_MMAP_THRESHOLD, MAP_THRESHOLD)
        c.mallopt(M_TRIM_THRESHOLD, trim)
