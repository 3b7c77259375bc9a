"""Zero-filled host buffers whose pages become resident only when first written.

Why: `np.zeros` and `torch.zeros` may take their memory from malloc's heap, which must then clear
it by hand, so a buffer sized for the worst case (every row of the persistent batch at the longest
context, the whole KV cache) is resident at once. An anonymous memory map reads as zeros and the
OS backs a page only when it is written.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch


def zero_pages(nbytes: int, small_pages: bool = False) -> mmap.mmap:
    """`nbytes` (> 0) of anonymous memory reading as zeros. `small_pages` asks the OS not to back
    it with transparent huge pages, each of which would make 2 MiB resident at the first write.

    Private, not shared: a shared anonymous map is shmem, where even reading a page makes it
    resident; a private one reads unwritten pages from the one zero page."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if small_pages and hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere the OS's default page size
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return pages


def zeros_array(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """A writable zero array of `shape` on zero pages; it keeps its map alive."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes == 0:  # the OS refuses a zero-length map
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(zero_pages(nbytes), dtype=dtype).reshape(shape)


def zeros_tensor(shape: tuple[int, ...], dtype: torch.dtype, small_pages: bool = False) -> torch.Tensor:
    """A CPU zero tensor of `shape` on zero pages (`small_pages` as for `zero_pages`); it keeps its
    map alive as long as it or a view of it lives."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:  # the OS refuses a zero-length map
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(zero_pages(nbytes, small_pages), dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
