"""Worst-case host buffers sit on zero pages: only what is written becomes resident."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading

import numpy as np

from forerun.worker.input_batch import InputBatch
from forerun.worker.zero_pages import zeros_array


def _resident_kib(array: np.ndarray) -> int:
    """KiB of `array`'s own pages that are resident (mincore: neighbouring maps the OS merged with its
    own are not counted)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    pages = -(-(array.ctypes.data + array.nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page // 1024


def test_the_token_buffer_makes_only_written_rows_resident() -> None:
    # As in a worker after a model load: freed large arrays raised malloc's threshold, and the
    # thread's heap holds freed memory, so a 16 MiB np.zeros came from it, cleared by hand: resident.
    for _ in range(3):
        np.ones(24 << 20, np.uint8).fill(1)
    made: list[InputBatch] = []

    def build() -> None:
        scratch = [np.ones(1 << 20, np.uint8) for _ in range(24)]
        del scratch
        made.append(InputBatch(256, 8192, 512))

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    buf = made[0].token_buf
    assert buf.shape == (256, 8192) and buf.dtype == np.int64
    buf[3, :100] = np.arange(100)
    resident = _resident_kib(buf)
    assert resident < 256, f"a 16 MiB buffer with one 100-token row written: {resident} KiB resident"
    # Read last: mincore counts a page mapped to the shared zero page by a read as resident.
    assert buf[3, :100].tolist() == list(range(100)) and buf.sum() == sum(range(100))


def test_zeros_array_is_a_writable_zero_array_of_any_shape() -> None:
    a = zeros_array((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.writeable and not a.any()
    a[1, 2] = 7.0
    assert a.sum() == 7.0
    assert zeros_array((0, 4), np.int32).shape == (0, 4)  # no pages: a zero-length map is refused
