"""The byte-level BPE alphabet (GPT-2 style), shared by GGUF conversion and the grammar backend."""

from __future__ import annotations

from functools import cache


@cache
def byte_level_alphabet() -> dict[int, str]:
    """Byte -> printable character, reversible.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) move to
    code points from U+0100 upward, in byte order, so every vocabulary entry is visible text.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table
