"""Whether a GGUF model's one-row matmuls run faster over 16-bit activations on this CPU: measured once,
cached.

At one decode row the block GEMV (csrc/gemv_kquant.c) expands every weight to fp32 and is bound by
those instructions rather than by memory; the GEMV over integer activations (csrc/gemv_int.c) rounds
the activations to 16 bits per 32 values and multiplies the weights' codes in integers. Its results
are within about 2^-16 of the fp32 ones, relative to the sizes of the terms (bf16 activations: 2^-8),
so greedy answers stay the fp32 model's in practice (docs/cpu-kernels.md gives the measurement).
Which is faster depends on the CPU (on an AMD EPYC with AVX2 only, 1.4-2.2x for the 16-bit one, by
format), so `dtype="auto"` times both over the model's own decode matmuls at one row, in its main
format, and takes 16 bits where they are at least INT16_GAIN times as fast. The answer is cached
beside the other probes', keyed by CPU, kernel build, threads, shapes and format. 8 bits (llama.cpp's
choice) changes answers, so no probe turns it on. (Where batch invariance is on, or a dtype is given
or pinned, the engine keeps fp32 products and this probe does not run: forerun.worker.numerics.)
"""

from __future__ import annotations

import ctypes
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from forerun.kernels.build import build_name
from forerun.kernels.busy_watch import BusyWatch
from forerun.kernels.compact_weights import CompactWeight, block_size
from forerun.kernels.kquant_gemv import INT_FORMATS, KQuantGemv
from forerun.kernels.probe import BUSY, PROBE_MAX_ELEMENTS, best_rounds, fresh_entry, read_cache, write_cache
from forerun.platform import cpu_signature

logger = logging.getLogger(__name__)

# How much faster the 16-bit GEMV must be to give up exact fp32 products by default: a clear win, not
# one noisy round.
INT16_GAIN = 1.1


@dataclass(frozen=True)
class ActivationChoice:
    """The activations' width for one-row block matmuls (32: fp32, 16: integers), and the measured
    speed-up behind it (fp32 GEMV seconds over 16-bit GEMV seconds; 0.0 where nothing was measured)."""

    bits: int
    speedup: float

    def describe(self) -> str:
        return f"{self.bits}-bit (16-bit GEMV {self.speedup:.2f}x the fp32 GEMV at one row)"


def full_width(k: int, n: int, count: float) -> tuple[int, int, float]:
    """(k, n, count) with n set so that k * n is the probe's cap (PROBE_MAX_ELEMENTS), count changed to
    keep the work. Why: each timed call goes through Python, microseconds that the one-call decode
    step does not pay per matmul; at a small matrix's own width they hid much of the 16-bit GEMV's
    gain (SmolLM2's 576-wide Q4_1 matmuls: 1.07-1.27x in different runs, 1.30-1.33x at full width,
    where the model's decode ran about 1.2x as fast; AMD EPYC, AVX2 only)."""
    wide = max(16, PROBE_MAX_ELEMENTS // k)
    return k, wide, count * n / wide


def measure_int16_speedup(lib: ctypes.CDLL, shapes: list[tuple[int, int, int]], fmt: str, rounds: int = 5) -> float:
    """fp32 GEMV time over 16-bit GEMV time for one row through `shapes` ((in, out, count), each timed
    at full_width) over random `fmt` blocks, timed round-robin (best round each)."""
    gen = torch.Generator().manual_seed(0)  # never the global RNG: see probe.measure
    fp32, int16 = [], []
    with torch.inference_mode():
        for k, n, count in (full_width(k, n, c) for k, n, c in shapes if k % block_size(fmt) == 0):
            w = CompactWeight.random(fmt, n, k, gen)
            x = torch.rand(1, k, generator=gen)
            fp32.append((KQuantGemv(lib, w.data, fmt, k), x, count))
            int16.append((KQuantGemv(lib, w.data, fmt, k, activation_bits=16), x, count))
        if not fp32:
            return 0.0
        for fn, x, _ in fp32 + int16:
            fn(x)  # first call: page faults and thread start-up
        fp32_s, int16_s = best_rounds([fp32, int16], rounds)
    return fp32_s / int16_s


def choose_activation_bits(lib: ctypes.CDLL, shapes: list[tuple[int, int, int]], fmt: str,
                           cache_file: Path | None) -> ActivationChoice:
    """16 or 32 bits for one-row matmuls in `fmt` (see the module docstring), from `cache_file` when
    this machine measured it."""
    if fmt not in INT_FORMATS:
        return ActivationChoice(32, 0.0)
    key = json.dumps(["int16_gemv_full_width", build_name(lib), cpu_signature(), torch.__version__,
                      torch.get_num_threads(), shapes, fmt])
    cache = read_cache(cache_file)
    entry = fresh_entry(cache.get(key))
    if entry is not None and isinstance(entry.get("speedup"), float):
        return ActivationChoice(16 if entry["speedup"] >= INT16_GAIN else 32, entry["speedup"])
    watch, t0 = BusyWatch(), time.perf_counter()
    speedup = measure_int16_speedup(lib, shapes, fmt)
    logger.info("measured the 16-bit GEMV in %.1f s", time.perf_counter() - t0)
    choice = ActivationChoice(16 if speedup >= INT16_GAIN else 32, speedup)
    if cache_file is not None:
        cache[key] = {**asdict(choice), BUSY: watch.busy()}
        write_cache(cache_file, cache)
    return choice
