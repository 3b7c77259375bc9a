"""Worst-case host buffers sit on zero pages: only what is written becomes resident."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np

from forerun.worker.input_batch import InputBatch
from forerun.worker.zero_pages import zeros_array


def _resident_kib_of_mapping(address: int) -> int:
    """Rss (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


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
    assert buf.shape == (256, 8192) and buf.dtype == np.int64 and not buf.any()
    buf[3, :100] = np.arange(100)
    resident = _resident_kib_of_mapping(buf.ctypes.data)
    assert resident < 1024, f"a 16 MiB buffer with one 100-token row written: {resident} KiB resident"


def test_zeros_array_is_a_writable_zero_array_of_any_shape() -> None:
    a = zeros_array((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.writeable and not a.any()
    a[1, 2] = 7.0
    assert a.sum() == 7.0
    assert zeros_array((0, 4), np.int32).shape == (0, 4)  # no pages: a zero-length map is refused
