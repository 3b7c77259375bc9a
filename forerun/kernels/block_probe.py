"""The arithmetic of a GGUF model's batched matmuls on this CPU, measured once, cached: and with it,
whether batch invariance is on by default.

A GGUF file's quantized matrices are multiplied from their blocks. Few rows run the block GEMV in fp32
arithmetic whatever the engine's dtype. Many rows have up to three candidates (the last two on CPUs with AVX-512 only):

  float32/lanes:   the lane matmul (forerun.kernels.lane_matmul), fp32 products summed in the GEMV's
                   own order, so a row's result is the same at every batch size (batch-invariant);
  float32/blocks:  the block matmul's fp32 variant, one fma chain over k per output (another order);
  bfloat16/blocks: on CPUs with AVX512_BF16, its bf16 variant (vdpbf16ps, bf16-rounded weights).

`choose_block_dtype` times them at the decode batch size on the model's own shapes and format. Batch
invariance is the default where the lane matmul keeps INVARIANT_COST of the fastest (it costs at most
5% of the batched throughput); elsewhere the fastest runs and invariance is a switch. The answer is
cached beside the dense probe's (forerun.kernels.probe), keyed by CPU, kernel build, threads, shapes
and format.
"""

from __future__ import annotations

import ctypes
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from forerun.kernels.block_matmul import BlockMatmul
from forerun.kernels.block_matmul import available_isas as block_isas
from forerun.kernels.build import build_name
from forerun.kernels.compact_weights import CompactWeight, block_size
from forerun.kernels.lane_matmul import LaneMatmul
from forerun.kernels.probe import BUSY, best_rounds, capped, fresh_entry, machine_busy, read_cache, write_cache
from forerun.platform import cpu_signature

logger = logging.getLogger(__name__)

# The share of the fastest batched throughput the batch-invariant arithmetic must keep to be the default.
INVARIANT_COST = 0.95
LANES, FP32_BLOCKS, BF16_BLOCKS = "float32/lanes", "float32/blocks", "bfloat16/blocks"


@dataclass(frozen=True)
class BlockChoice:
    """The dtype a GGUF model runs in, whether batch invariance is the default (the lane matmul kept
    INVARIANT_COST of the fastest; its dtype is then float32), and the GFLOPS each candidate reached at
    the decode batch size."""

    dtype: str
    invariant: bool
    gflops: dict[str, float]

    def describe(self) -> str:
        speeds = ", ".join(f"{name} {g:.0f}" for name, g in sorted(self.gflops.items(), key=lambda kv: -kv[1]))
        mode = "batch-invariant" if self.invariant else "batch-variant"
        return f"{self.dtype} {mode} block matmuls (GFLOPS at the decode batch: {speeds})"


def block_candidates(lib: ctypes.CDLL) -> list[str]:
    """The lane matmul always; the block matmul's fp32 and bf16 variants where it has their AVX-512
    paths (its portable path is no contender, and bf16 without AVX512_BF16 is emulated)."""
    return ([LANES] + ([FP32_BLOCKS] if "avx512" in block_isas(lib, torch.float32) else [])
            + ([BF16_BLOCKS] if "avx512" in block_isas(lib, torch.bfloat16) else []))


def measure_blocks(lib: ctypes.CDLL, shapes: list[tuple[int, int, int]], fmt: str, batch: int,
                   candidates: list[str], rounds: int = 5) -> dict[str, float]:
    """GFLOPS of one decode step's matmuls ((in, out, count) at `batch` rows) over random `fmt` blocks,
    per candidate, timed round-robin (best round each)."""
    shapes = [capped(k, n, count) for k, n, count in shapes if k % block_size(fmt) == 0]
    flops = sum(2.0 * batch * k * n * count for k, n, count in shapes)
    gen = torch.Generator().manual_seed(0)  # never the global RNG: see probe.measure
    calls: dict[str, list] = {name: [] for name in candidates}
    with torch.inference_mode():
        for k, n, count in shapes:
            w = CompactWeight.random(fmt, n, k, gen)
            x = torch.rand(batch, k, generator=gen)
            make = {LANES: lambda: (LaneMatmul(lib, w.data, fmt, k), x),
                    FP32_BLOCKS: lambda: (BlockMatmul(lib, w.data, fmt, k), x),
                    BF16_BLOCKS: lambda: (BlockMatmul(lib, w.data, fmt, k), x.to(torch.bfloat16))}
            for name in candidates:
                calls[name].append((*make[name](), count))
        for fns in calls.values():
            for fn, x, _ in fns:
                fn(x)  # first call: page faults and thread start-up
        best = best_rounds(list(calls.values()), rounds)
    return {name: flops / sec / 1e9 for name, sec in zip(calls, best)}


def choose_block_dtype(lib: ctypes.CDLL, shapes: list[tuple[int, int, int]], fmt: str, batch: int,
                       cache_file: Path | None) -> BlockChoice:
    """The GGUF model's arithmetic (see the module docstring), from `cache_file` when this machine
    measured it."""
    candidates = block_candidates(lib)
    if candidates == [LANES]:  # nothing to measure against (no AVX-512)
        return BlockChoice("float32", True, {})
    key = json.dumps(["block_dtype", build_name(lib), cpu_signature(), torch.__version__, torch.get_num_threads(),
                      batch, shapes, fmt, candidates])
    cache = read_cache(cache_file)
    cached = _choice_from(fresh_entry(cache.get(key)), candidates)
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    busy = machine_busy()
    gflops = measure_blocks(lib, shapes, fmt, batch, candidates)
    busy = busy or machine_busy()
    choice = decide(gflops)
    logger.info("measured block matmul speed in %.1f s", time.perf_counter() - t0)
    if cache_file is not None:
        cache[key] = {**asdict(choice), BUSY: busy}
        write_cache(cache_file, cache)
    return choice


def decide(gflops: dict[str, float]) -> BlockChoice:
    """Invariant fp32 where the lane matmul keeps INVARIANT_COST of the fastest, else the fastest."""
    fastest = max(gflops, key=lambda name: gflops[name])
    if gflops[LANES] >= INVARIANT_COST * gflops[fastest]:
        return BlockChoice("float32", True, gflops)
    return BlockChoice(fastest.split("/")[0], False, gflops)


def _choice_from(entry: dict | None, candidates: list[str]) -> BlockChoice | None:
    """The cached choice, or None (measure again) for an absent or damaged entry."""
    if entry is None or set(entry) != {"dtype", "invariant", "gflops"}:
        return None
    gflops = entry["gflops"]
    if not isinstance(gflops, dict) or set(gflops) != set(candidates):
        return None
    if not all(isinstance(g, (int, float)) and not isinstance(g, bool) for g in gflops.values()):
        return None
    choice = decide({n: float(g) for n, g in gflops.items()})
    return choice if (choice.dtype, choice.invariant) == (entry["dtype"], entry["invariant"]) else None
