"""The arithmetic of a GGUF model's batched matmuls on this CPU, measured once, cached: and with it,
whether batch invariance is on by default.

A GGUF file's quantized matrices are multiplied from their blocks. Few rows run the block GEMV in fp32
arithmetic whatever the engine's dtype. Many rows have up to three candidates (the second on CPUs
with AVX2 or AVX-512, the third on those with AVX512_BF16):

  float32/lanes:   the lane matmul (forerun.kernels.lane_matmul), fp32 products summed in the GEMV's
                   own order, so a row's result is the same at every batch size (batch-invariant);
  float32/blocks:  the block matmul's fp32 variant, one fma chain over k per output (another order);
  bfloat16/blocks: on CPUs with AVX512_BF16, its bf16 variant (vdpbf16ps, bf16-rounded weights).

`choose_block_dtype` times them on the model's own shapes and format where a batched workload runs
them (a `Workload`): a decode step of DECODE_ROWS rows, and a prefill chunk of PREFILL_ROWS tokens
(the layers' matmuls; logits are taken of a prompt's last token only). The 5% is of throughput, so a
candidate's speed is the matmuls' GFLOPS over the time of a workload of as many prompt tokens as
output tokens, as the 64 x 128/128 benchmark: one token of each, whose matmul times add, and the
decode token's attention over PROBE_CONTEXT positions, which every candidate pays alike. Judging the
decode step's matmuls alone misjudges the cost: on an Intel Xeon with AVX-512 the lane matmul keeps
0.87-0.89 of the fp32 block matmul at 64 rows but 1.04-1.06 at 4,096, and the whole engine kept
0.95-1.00 of its batch-variant throughput at 64 x 128/128. What the probe leaves out (prefill
attention, norms, sampling, the engine) also costs every candidate alike, so it errs toward calling
invariance dear, as does the short context (longer ones give attention a larger share). Batch
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
from types import SimpleNamespace
from typing import NamedTuple

import torch

from forerun.kernels.attention import DecodeAttention
from forerun.kernels.block_matmul import BlockMatmul
from forerun.kernels.block_matmul import vectorised
from forerun.kernels.build import build_name
from forerun.kernels.compact_weights import CompactWeight, block_size
from forerun.kernels.lane_matmul import LaneMatmul
from forerun.kernels.busy_watch import BusyWatch
from forerun.kernels.probe import BUSY, best_rounds, capped, fresh_entry, read_cache, write_cache
from forerun.platform import cpu_signature

logger = logging.getLogger(__name__)

# The share of the fastest batched throughput the batch-invariant arithmetic must keep to be the default.
INVARIANT_COST = 0.95
LANES, FP32_BLOCKS, BF16_BLOCKS = "float32/lanes", "float32/blocks", "bfloat16/blocks"
# Rows of the prefill chunk timed: the default token budget, which a batch of prompts fills (the
# matmuls' speed has settled by here). Fixed rather than read from the engine's budget, so that the
# default mode, and with it a request's bits, does not change with that setting.
PREFILL_ROWS = 4096
# The most weights of one timed prefill matrix: at thousands of rows a narrower matrix runs at the
# same speed, in a quarter of the time.
PREFILL_MAX_ELEMENTS = 1 << 20
# Rows of the decode step timed: the batch the 5% rule is stated for, fixed for the same reason.
DECODE_ROWS = 64
# Context of the decode rows whose attention the probe times: a short chat turn (longer contexts make
# attention a larger share of a step, so invariance cheaper).
PROBE_CONTEXT = 256


class AttentionShape(NamedTuple):
    """A model's attention on one rank: query heads, KV heads, head dim, and how many layers attend."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int


@dataclass(frozen=True)
class Workload:
    """What the probe times, per rank: (in, out, count) of the matmuls an output token passes through
    (`decode`) and a prompt token (`prefill`: no logits), at `decode_rows` and `prefill_rows` rows; and
    the attention (None: not timed, a shape the C kernel does not take)."""

    decode: list[tuple[int, int, int]]
    prefill: list[tuple[int, int, int]]
    decode_rows: int
    prefill_rows: int
    attention: AttentionShape | None


@dataclass(frozen=True)
class BlockChoice:
    """The dtype a GGUF model runs in, whether batch invariance is the default (the lane matmul kept
    INVARIANT_COST of the fastest; its dtype is then float32), and the GFLOPS each candidate reached over
    a decode step and a prefill chunk (see the module docstring)."""

    dtype: str
    invariant: bool
    gflops: dict[str, float]

    def describe(self) -> str:
        speeds = ", ".join(f"{name} {g:.0f}" for name, g in sorted(self.gflops.items(), key=lambda kv: -kv[1]))
        mode = "batch-invariant" if self.invariant else "batch-variant"
        return (f"{self.dtype} {mode} block matmuls "
                f"(GFLOPS over a decode and a prefill token, attention included: {speeds})")


def block_candidates(lib: ctypes.CDLL) -> list[str]:
    """The lane matmul always; the block matmul's fp32 variant where it has a vector path (AVX2 or
    AVX-512), its bf16 variant where it has the AVX512_BF16 one (the portable paths are no contenders,
    and bf16 without AVX512_BF16 is emulated)."""
    return ([LANES] + ([FP32_BLOCKS] if vectorised(lib, torch.float32) else [])
            + ([BF16_BLOCKS] if vectorised(lib, torch.bfloat16) else []))


def measure_blocks(lib: ctypes.CDLL, shapes: list[tuple[int, int, int]], fmt: str, batch: int,
                   candidates: list[str], rounds: int = 5, limit: int | None = None) -> dict[str, float]:
    """GFLOPS of one step's matmuls ((in, out, count) at `batch` rows, each cut to `limit` weights, the
    probe's usual cap when None) over random `fmt` blocks, per candidate, timed round-robin (best round
    each)."""
    flops = batch * _flops(shapes, fmt)
    shapes = [capped(k, n, count, limit) for k, n, count in shapes if k % block_size(fmt) == 0]
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


def attention_seconds(lib: ctypes.CDLL, shape: AttentionShape, batch: int, context: int = PROBE_CONTEXT,
                      rounds: int = 5) -> float:
    """Seconds one decode token spends in attention (forerun.kernels.attention, fp32) when `batch` rows
    of `context` positions decode together: one layer's cache timed, times the layers, over the rows."""
    block = 16
    per_row = -(-context // block)
    gen = torch.Generator().manual_seed(0)
    cache = torch.rand(2, batch * per_row, block, shape.kv_heads, shape.head_dim, generator=gen)
    meta = SimpleNamespace(all_decode=True, slot_mapping=torch.zeros(batch, dtype=torch.int64),
                           decode_blocks=torch.arange(batch * per_row, dtype=torch.int64),
                           decode_seq_lens=torch.full((batch,), context, dtype=torch.int64), decode_len=per_row * block)
    q = torch.rand(batch, shape.heads, shape.head_dim, generator=gen)
    attend = DecodeAttention(lib)
    attend(q, cache, meta, shape.head_dim ** -0.5, None)  # first call: page faults and thread start-up
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        attend(q, cache, meta, shape.head_dim ** -0.5, None)
        best = min(best, time.perf_counter() - t0)
    return best * shape.layers / batch


def workload_gflops(decode: dict[str, float], prefill: dict[str, float], decode_flops: float,
                    prefill_flops: float, shared_seconds: float = 0.0) -> dict[str, float]:
    """Each candidate's matmul GFLOPS over the time of one output token (a decode step's matmuls,
    `decode_flops` a token, at `decode` GFLOPS) and one prompt token (`prefill_flops` at `prefill`
    GFLOPS), plus `shared_seconds` a pair that every candidate spends alike (the decode token's
    attention): total work over the total time."""
    return {name: (decode_flops + prefill_flops) / 1e9
            / (decode_flops / decode[name] / 1e9 + prefill_flops / prefill[name] / 1e9 + shared_seconds)
            for name in decode}


def choose_block_dtype(lib: ctypes.CDLL, work: Workload, fmt: str, cache_file: Path | None) -> BlockChoice:
    """The GGUF model's arithmetic (see the module docstring), from `cache_file` when this machine
    measured it."""
    candidates = block_candidates(lib)
    if candidates == [LANES]:  # nothing to measure against (no vector path)
        return BlockChoice("float32", True, {})
    key = json.dumps(["block_dtype", build_name(lib), cpu_signature(), torch.__version__, torch.get_num_threads(),
                      asdict(work), PROBE_CONTEXT, fmt, candidates])
    cache = read_cache(cache_file)
    cached = _choice_from(fresh_entry(cache.get(key)), candidates)
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    watch = BusyWatch()
    gflops = workload_gflops(
        measure_blocks(lib, work.decode, fmt, work.decode_rows, candidates),
        measure_blocks(lib, work.prefill, fmt, work.prefill_rows, candidates, rounds=3, limit=PREFILL_MAX_ELEMENTS),
        _flops(work.decode, fmt), _flops(work.prefill, fmt),
        0.0 if work.attention is None else attention_seconds(lib, work.attention, work.decode_rows))
    busy = watch.busy()
    choice = decide(gflops)
    logger.info("measured block matmul speed in %.1f s", time.perf_counter() - t0)
    if cache_file is not None:
        cache[key] = {**asdict(choice), BUSY: busy}
        write_cache(cache_file, cache)
    return choice


def _flops(shapes: list[tuple[int, int, int]], fmt: str) -> float:
    """FLOPs of one token through the matmuls measure_blocks times (those whose k holds whole blocks)."""
    return sum(2.0 * k * n * count for k, n, count in shapes if k % block_size(fmt) == 0)


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
