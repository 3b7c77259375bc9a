"""Where each tensor of a GGUF file lies, read from its header without parsing the metadata's values.

gguf.GGUFReader builds a Python object for every metadata item, which for a 49k-token vocabulary
takes seconds; loading weights needs only the tensor table, so this walks the header with `struct`
and skips the values (the tokenizer and config are read once, when the model folder is described).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _U32, _U64 = 8, 9, 4, 10
_ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: its name, GGML type number, dimensions innermost first (as GGUF lists them) and the
    byte offset of its data in the file."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def skip_value(self, vtype: int) -> int | None:
        """Step over one value; returns it when it is an unsigned integer (the alignment is one)."""
        if vtype == _STRING:
            n = self.take("<Q")
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[item]  # count was read before this line runs
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif vtype in (_U32, _U64):
            return self.take("<I" if vtype == _U32 else "<Q")
        elif vtype in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[vtype]
        else:
            raise ValueError(f"gguf: unknown metadata value type {vtype}")
        return None


def read_index(path: Path) -> list[TensorEntry]:
    """The tensor table of a GGUF file (version 2 or 3), with absolute data offsets."""
    with open(path, "rb") as f:
        mapped = np.memmap(f, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError(f"gguf: {path} is not a GGUF file")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"gguf: version {version} of {path} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        value = cur.skip_value(cur.take("<I"))
        if key == _ALIGNMENT_KEY and value is not None:
            alignment = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    start = -(-cur.pos // alignment) * alignment
    return [TensorEntry(name, ggml_type, dims, start + offset) for name, dims, ggml_type, offset in infos]
