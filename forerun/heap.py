"""glibc's heap, held small: free pages handed back, and fixed thresholds for when they go back.

Torch-free, so that the server's front end, which never imports torch, can trim its heap too.
Elsewhere than glibc every function here does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

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
    the arena, `forerun serve` on SmolLM2 Q4_1 held 46 MB more resident without this; in the server's
    front end, the Rust tokenizer's parse of tokenizer.json left 17 MB free but resident."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """glibc's malloc_trim alone: the free pages of blocks already dropped, without a collection."""
    c = libc()
    if hasattr(c, "malloc_trim"):
        c.malloc_trim(0)


def settle_start_garbage(freeze: bool = False) -> None:
    """A full collection now, at the end of an engine's start; with `freeze`, also move every object
    still alive into the collector's permanent generation, which later collections never walk.

    Why: CPython starts a full collection once the objects that reached its oldest generation since
    the last full one exceed a quarter of those that one found. The last before serving ran during the
    imports, so loading the model passed that mark and the next came in the first steps, walking some
    220,000 objects in 70-135 ms with the GIL held, on the engine or the worker thread: the model
    waited too. The tiny random model's README run counted it as 2.8-3.7 ms of engine thread a step
    instead of 1.3-1.5 (256 prompts x 32 / 64, Intel Xeon).

    Called where forerun owns the process: the engine core's and the workers' (which freeze, so that
    their later full collections walk only what serving made) and the benchmarks' (which collect
    only, as they build one engine after another). Not in a user's process (LLM, an RL trainer): there
    it would only move the same walk to the start, 0.1-0.4 s an engine in a large heap (a test
    process), and a freeze would keep the user's cyclic garbage for good."""
    gc.collect()
    if freeze:
        gc.freeze()


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
