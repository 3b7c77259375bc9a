"""Which dtype and matmul kernel run a model's decode step fastest on this CPU: measured once, cached.

CPUs of one name disagree: on one machine fp32 matmuls beat bf16, on another (avx512_bf16) bf16 is
2-3x faster, and on a machine without AVX-512 bf16 is emulated and 7x slower. So `dtype="auto"`
times every (dtype, kernel) pair on the model's own matmul shapes at its decode batch size and keeps
the fastest. The answer is cached under the forerun cache folder, keyed by CPU model and flags,
torch version, thread count and shapes, so only the first start on a machine pays (about a second).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from forerun.kernels import busy_watch
from forerun.kernels.busy_watch import BusyWatch
from forerun.kernels.compact_weights import CompactWeight, block_size
from forerun.kernels.gemm import PackedGemm
from forerun.kernels.gemv import CompactGemv
from forerun.kernels.linear import available_kernels, make_linear
from forerun.kernels.types import LinearFn
from forerun.platform import cpu_signature

logger = logging.getLogger(__name__)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class KernelChoice:
    """The fastest candidate and what every candidate reached (GFLOPS over the model's matmuls)."""

    dtype: str
    linear_kernel: str
    gflops: dict[str, float]

    @property
    def torch_dtype(self) -> torch.dtype:
        return {v: k for k, v in DTYPE_NAMES.items()}[self.dtype]

    def describe(self) -> str:
        speeds = ", ".join(f"{name} {g:.0f}" for name, g in sorted(self.gflops.items(), key=lambda kv: -kv[1]))
        return f"{self.dtype} with {self.linear_kernel} matmuls (GFLOPS at decode shapes: {speeds})"


def measure(shapes: list[tuple[int, int, int]], batch: int, candidates: list[tuple[torch.dtype, str]],
            rounds: int = 5, gemm: PackedGemm | None = None) -> dict[str, float]:
    """Achieved GFLOPS of one decode step's matmuls ((in, out, count) at `batch` rows) per candidate.

    Candidates are timed round-robin, each keeping its best round (`best_rounds`), so the ranking
    survives the noise of a shared machine. A matrix of more than PROBE_MAX_ELEMENTS weights (a large
    LM head) is timed as a narrower one counted more times: every candidate's weights are held at
    once, and a 1B model's full set would take gigabytes for a ranking that a slice gives as well.
    """
    shapes = [capped(k, n, count) for k, n, count in shapes]
    flops = sum(2.0 * batch * k * n * count for k, n, count in shapes)
    # Its own generator: the probe runs on rank 0 only and only when nothing is cached, so a draw from
    # torch's global RNG would leave rank 0 (and a first start) sampling another stream than the rest.
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        prepared = []
        for dtype, kernel in candidates:
            layers = []
            for k, n, count in shapes:
                # Scaled like real weights: huge values would hit slow denormal/overflow paths.
                w = (torch.rand(n, k, generator=gen) - 0.5).mul_(0.1).to(dtype)
                fn = make_linear(w, None, kernel, batch, gemm)
                x = torch.rand(batch, k, generator=gen).to(dtype)
                fn(x)  # first call: allocation and kernel selection
                layers.append((fn, x, count))
            prepared.append((f"{DTYPE_NAMES[dtype]}/{kernel}", layers))
        best = best_rounds([layers for _, layers in prepared], rounds)
    return {name: flops / sec / 1e9 for (name, _), sec in zip(prepared, best)}


PROBE_MAX_ELEMENTS = 1 << 22


def capped(k: int, n: int, count: float, limit: int | None = None) -> tuple[int, int, float]:
    """(k, n, count) with n cut so that k * n <= limit (PROBE_MAX_ELEMENTS when None, read at the call),
    count raised to keep the FLOPs."""
    narrow = max(16, min(n, (PROBE_MAX_ELEMENTS if limit is None else limit) // k))
    return k, narrow, count * n / narrow


def best_rounds(candidates: list[list[tuple[LinearFn, torch.Tensor, float]]], rounds: int) -> list[float]:
    """Seconds of each candidate's calls (fn, input, weight: each call's time counts `weight` times),
    timed round-robin, the best round of each. Another process taking a core for a moment then slows
    one round of every candidate alike instead of all rounds of one."""
    best = [float("inf")] * len(candidates)
    for _ in range(rounds):
        for i, calls in enumerate(candidates):
            seconds = 0.0
            for fn, x, weight in calls:
                t0 = time.perf_counter()
                fn(x)
                seconds += (time.perf_counter() - t0) * weight
            best[i] = min(best[i], seconds)
    return best


def choose_kernels(shapes: list[tuple[int, int, int]], batch: int, dtypes: list[torch.dtype],
                   kernels: list[str] | None, cache_file: Path | None,
                   gemm: PackedGemm | None = None) -> KernelChoice:
    """The fastest (dtype, kernel) for these matmuls, from `cache_file` when this machine measured it.

    `kernels` None means every kernel this CPU has (`native` when `gemm`, forerun's C GEMM, is
    given); a single candidate is returned unmeasured.
    """
    device = torch.device("cpu")
    candidates = [(d, k) for d in dtypes for k in available_kernels(d, device, gemm) if kernels is None or k in kernels]
    if not candidates:
        names = ", ".join(DTYPE_NAMES[d] for d in dtypes)
        raise ValueError(f"linear_kernel: {kernels} cannot run {names} on this CPU "
                         f"(available: {available_kernels(dtypes[0], device, gemm)})")
    if len(candidates) == 1:
        return KernelChoice(DTYPE_NAMES[candidates[0][0]], candidates[0][1], {})
    # The C kernels' build names their sources: a changed GEMM is timed again.
    build = gemm.build if gemm is not None and any(k == "native" for _, k in candidates) else None
    key = json.dumps([cpu_signature(), torch.__version__, torch.get_num_threads(), batch, shapes,
                      [(DTYPE_NAMES[d], k) for d, k in candidates], *([build] if build else [])])
    cache = read_cache(cache_file)
    cached = _choice_from(fresh_entry(cache.get(key)), [f"{DTYPE_NAMES[d]}/{k}" for d, k in candidates])
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    watch = BusyWatch()
    gflops = measure(shapes, batch, candidates, gemm=gemm)
    busy = watch.busy()
    best = max(gflops, key=lambda name: gflops[name])
    dtype_name, kernel = best.split("/")
    choice = KernelChoice(dtype_name, kernel, gflops)
    logger.info("measured matmul speed in %.1f s", time.perf_counter() - t0)
    if cache_file is not None:
        cache[key] = {**asdict(choice), BUSY: busy}
        write_cache(cache_file, cache)
    return choice


GEMV_ROWS = (1, 2, 4, 8, 16, 32, 64)
# Distinct weights at least this large per probe, more than the last-level caches here: a real step
# reads its weights from memory, and a probe that re-read one cached matrix would favour fp32.
PROBE_WEIGHT_BYTES = 64 << 20


# (compact form of a random [n, k] weight) -> (few-row matmul, or None where no GEMV reads it; batched matmul)
MatmulPair = Callable[[CompactWeight], tuple[LinearFn | None, LinearFn]]


def dense_pair(kernel: str, gemv: CompactGemv, dtype: torch.dtype, gemm: PackedGemm | None = None) -> MatmulPair:
    """A dense model's two matmuls: the compact GEMV over the weight's compact form, and `kernel` over
    the dense weight in `dtype` (the engine's: its activations convert to fp32 at the GEMV's boundary)."""
    return lambda w: (gemv.linear(w, None), make_linear(w.expand().to(dtype), None, kernel, 64, gemm))


def measure_gemv(shapes: list[tuple[int, int, int]], pair: MatmulPair, fmt: str, max_rows: int,
                 rounds: int = 3, dtype: torch.dtype = torch.float32) -> dict[int, float]:
    """Speed-up of the few-row matmul over the batched one (`pair`, over random weights in `fmt`) on
    one step's matmuls with inputs in `dtype`, per row count, up to the first row count where it
    loses (timed alternately, best round)."""
    total = sum(dtype.itemsize * k * n * count for k, n, count in shapes)
    speedup: dict[int, float] = {}
    gen = torch.Generator().manual_seed(0)  # never the global RNG: see `measure`
    with torch.inference_mode():
        layers = []
        for k, n, count in shapes:
            if k % block_size(fmt):
                continue  # a shard that would cut this format's blocks is held dense, not timed here
            copies = min(count, max(1, -(-count * PROBE_WEIGHT_BYTES // total)))
            for _ in range(copies):
                small, large = pair(CompactWeight.random(fmt, n, k, gen))
                if small is None:
                    return {}  # a shape the kernel does not take: the model keeps its batched matmuls
                layers.append((k, count / copies, small, large))
        for rows in (r for r in GEMV_ROWS if r <= max_rows):
            xs = {k: torch.rand(rows, k, generator=gen).to(dtype) for k, _, _ in shapes}
            compact_s, fp32_s = best_rounds([[(small, xs[k], weight) for k, weight, small, _ in layers],
                                             [(large, xs[k], weight) for k, weight, _, large in layers]], rounds)
            speedup[rows] = fp32_s / compact_s
            if speedup[rows] < 1.0:
                break
    return speedup


def choose_gemv_rows(shapes: list[tuple[int, int, int]], pair: MatmulPair, fmt: str, max_rows: int,
                     cache_file: Path | None, key_parts: list, dtype: torch.dtype = torch.float32
                     ) -> tuple[int, dict[int, float]]:
    """The most rows up to which the few-row matmul of `pair` beats its batched one with inputs in
    `dtype` at every measured row count (0: never), and the measured speed-ups; cached like
    `choose_kernels` under `key_parts` (what names the two kernels: their build, the batched kernel)."""
    key = json.dumps(["gemv_rows", *key_parts, cpu_signature(), torch.__version__, torch.get_num_threads(),
                      max_rows, shapes, fmt, DTYPE_NAMES[dtype]])
    cache = read_cache(cache_file)
    cached = _speedup_from(fresh_entry(cache.get(key)))
    if cached is not None:
        speedup = cached
    else:
        watch = BusyWatch()
        speedup = measure_gemv(shapes, pair, fmt, max_rows, dtype=dtype)
        busy = watch.busy()
        if cache_file is not None:
            cache[key] = {"speedup": speedup, BUSY: busy}
            write_cache(cache_file, cache)
    return gemv_rows_from(speedup), speedup


def gemv_rows_from(speedup: dict[int, float]) -> int:
    """The largest measured row count below which the GEMV never lost (0 when it lost at the first)."""
    rows = 0
    for r in sorted(speedup):
        if speedup[r] < 1.0:
            break
        rows = r
    return rows


BUSY = "measured_while_busy"


def fresh_entry(entry: dict | None) -> dict | None:
    """A cached entry without its bookkeeping, or None when it must be measured again: absent, or
    measured while the machine was busy and it is calm now (so a busy first start is not final)."""
    if not isinstance(entry, dict):
        return None
    entry = dict(entry)
    if entry.pop(BUSY, False) and not busy_watch.machine_busy():
        logger.info("re-measuring a matmul choice that was timed while the machine was busy")
        return None
    return entry


def _choice_from(entry: dict | None, candidates: list[str]) -> KernelChoice | None:
    """The cached choice, or None (measure again) unless the entry has exactly KernelChoice's fields
    with their types and names one of this probe's `candidates` ("dtype/kernel"): a damaged or
    hand-edited file must cost a measurement, not the start."""
    if entry is None or set(entry) != {"dtype", "linear_kernel", "gflops"}:
        return None
    dtype, kernel, gflops = entry["dtype"], entry["linear_kernel"], entry["gflops"]
    if not (isinstance(dtype, str) and isinstance(kernel, str) and f"{dtype}/{kernel}" in candidates):
        return None
    if not isinstance(gflops, dict) or not all(isinstance(n, str) and _is_number(g) for n, g in gflops.items()):
        return None
    return KernelChoice(dtype, kernel, {n: float(g) for n, g in gflops.items()})


def _speedup_from(entry: dict | None) -> dict[int, float] | None:
    """The cached GEMV speed-ups by row count, or None (measure again) when the entry is damaged."""
    if entry is None or set(entry) != {"speedup"} or not isinstance(entry["speedup"], dict):
        return None
    speedup = {}
    for rows, value in entry["speedup"].items():
        if not (isinstance(rows, str) and rows.isdigit() and int(rows) in GEMV_ROWS and _is_number(value)):
            return None
        speedup[int(rows)] = float(value)
    return speedup


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_cache(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a damaged cache only costs one more measurement


def write_cache(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)  # atomic: concurrent starts never read half a file
    except OSError as exc:
        logger.warning("could not cache the matmul probe in %s: %s", path, exc)
