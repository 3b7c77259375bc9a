"""How a worker's model computes: its dtype, its dense matmul kernel, whether batch invariance is on,
and the width of a GGUF model's small-matmul activations.

Explicit settings are kept (or refused with the field named). `dtype="auto"` is measured on this CPU
and cached: a dense model by the dense probe (forerun.kernels.probe), a GGUF file's quantized model by
the block probe (forerun.kernels.block_probe), which also says whether the batch-invariant matmul
keeps 95% of the fastest batched one's speed over decode steps and prefill chunks alike. Where it
does and `batch_invariant` is left unset, the mode is on: a GGUF model's small matmuls already sum in
that order, so one user pays nothing. Where it does not, and the dtype is auto, a GGUF model's
small matmuls round their inputs to 16 bits per 32 values if the int16 probe (forerun.kernels.int_probe)
finds that faster on this CPU; a dtype given or pinned keeps fp32 products. Rank 0 measures and every
rank takes its answer.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from forerun.config import EngineConfig
from forerun.kernels.attention import shape_supported
from forerun.kernels.block_matmul import vectorised
from forerun.kernels.block_probe import (DECODE_ROWS, PREFILL_ROWS, AttentionShape, Workload, choose_block_dtype,
                                         decide)
from forerun.kernels.gemm import PackedGemm
from forerun.kernels.int_probe import choose_activation_bits
from forerun.kernels.probe import DTYPE_NAMES, KernelChoice, choose_kernels
from forerun.loader.model_source import cache_dir
from forerun.loader.weights import gguf_quant_format, is_gguf_folder
from forerun.model.registry import model_matmul_shapes
from forerun.platform import parse_dtype

logger = logging.getLogger(__name__)

AUTO_DTYPES_ENV = "FORERUN_AUTO_DTYPES"


def auto_dtypes(environ: Mapping[str, str]) -> list[torch.dtype]:
    """The dtypes `dtype="auto"` measures: fp32 and bf16, or those named in $FORERUN_AUTO_DTYPES
    (comma-separated), so that a fleet of mixed CPUs can pin one choice and give the same tokens."""
    names = [n.strip() for n in environ.get(AUTO_DTYPES_ENV, "").split(",") if n.strip()]
    if not names:
        return [torch.float32, torch.bfloat16]
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"{AUTO_DTYPES_ENV}: unknown dtype {unknown[0]!r}; use {', '.join(by_name)}")
    return [by_name[n] for n in names]


@dataclass(frozen=True)
class Numerics:
    """The dtype and dense kernel (`choice`), whether batch invariance is on, and the width of small GGUF
    matmuls' activations (`activation_bits`: 32 fp32, 16 or 8 integers); the same on every rank."""

    choice: KernelChoice
    invariant: bool
    activation_bits: int = 32


class NumericsChooser:
    """Decides one worker's `Numerics` (see the module docstring); `decode_batch` is the batch size the
    dense probe measures at (the block probe's sizes are fixed: see `_workload`)."""

    def __init__(self, config: EngineConfig, hf_config: dict[str, Any], folder: Path, device: torch.device,
                 rank: int, world_size: int, tp_size: int, decode_batch: int, gemm: PackedGemm | None) -> None:
        self.config, self.hf_config, self.folder, self.device = config, hf_config, folder, device
        self.rank, self.world_size, self.tp_size = rank, world_size, tp_size
        self.decode_batch, self.gemm = decode_batch, gemm

    def choose(self, lib: ctypes.CDLL | None) -> Numerics:
        want = self.config.batch_invariant
        if want:
            self.check_batch_invariant(lib)
            return Numerics(self._invariant_kernels(), True)
        fmt = gguf_quant_format(self.folder) if lib is not None and self.device.type == "cpu" else None
        if fmt is None or parse_dtype(self.config.dtype, self.device) not in (None, torch.float32):
            return Numerics(self._choose_kernels(), False, self.config.activation_bits or 32)
        assert lib is not None
        dtype, cheap = self._block_choice(lib, fmt)
        if cheap and want is None and self._invariance_fits(lib):
            return Numerics(self._invariant_kernels(), True)
        return Numerics(self._choose_kernels([getattr(torch, dtype)]), False, self._activation_bits(lib, fmt))

    def _activation_bits(self, lib: ctypes.CDLL, fmt: str) -> int:
        """Small GGUF matmuls' activation width (batch invariance off): as configured; unset, measured on
        rank 0 (forerun.kernels.int_probe) where dtype is auto and $FORERUN_AUTO_DTYPES pins nothing, so
        that a dtype given, or pinned for a fleet, keeps fp32 products."""
        want = self.config.activation_bits
        if want is not None:
            return want
        if parse_dtype(self.config.dtype, self.device) is not None or os.environ.get(AUTO_DTYPES_ENV, "").strip():
            return 32
        result = None
        if self.rank == 0:
            choice = choose_activation_bits(lib, model_matmul_shapes(self.hf_config, self.tp_size), fmt,
                                            cache_dir() / "cpu_probe.json")
            logger.info("small GGUF %s matmuls' activations: %s", fmt, choice.describe())
            result = choice.bits
        return self._from_rank0(result)

    def check_batch_invariant(self, lib: ctypes.CDLL | None) -> None:
        """Raise ValueError naming the field where batch-invariant mode cannot run."""
        if self.device.type != "cpu":
            raise ValueError("batch_invariant: CPU only; on CUDA forerun runs stock (batch-variant) kernels")
        if lib is None:
            raise ValueError("batch_invariant: needs forerun's C kernels (native_kernels on, a C compiler)")
        fixed = parse_dtype(self.config.dtype, self.device)
        bf16_blocks = is_gguf_folder(self.folder) and vectorised(lib, torch.bfloat16)
        if fixed not in (None, torch.float32) and not (fixed == torch.bfloat16 and bf16_blocks):
            raise ValueError(f"batch_invariant: runs in float32, or in bfloat16 over a GGUF file's blocks on a CPU "
                             f"with AVX512_BF16; not {self.config.dtype} here")
        c = self.hf_config
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        if not shape_supported(heads, c.get("num_key_value_heads", heads), head_dim):
            raise ValueError(f"batch_invariant: the C attention kernel does not take {heads} heads of {head_dim}")

    def _invariance_fits(self, lib: ctypes.CDLL) -> bool:
        """Whether the mode can be turned on unasked: no setting that it refuses was given."""
        cfg = self.config
        if cfg.activation_bits in (16, 8) or cfg.gemv_max_rows is not None or cfg.dense_weights:
            return False
        if cfg.linear_kernel not in ("auto", "native"):
            return False
        try:
            self.check_batch_invariant(lib)
        except ValueError:
            return False
        return True

    def _invariant_kernels(self) -> KernelChoice:
        """Batch-invariant mode's fixed choice: fp32 (or bf16 as asked, GGUF blocks only) with dense
        matrices on forerun's packed fp32 GEMM, whose sum over k for each output runs in order whatever
        the number of rows (GGUF blocks: the block GEMV and the lane matmul, one order)."""
        dtype = parse_dtype(self.config.dtype, self.device) or torch.float32
        # bf16 (GGUF blocks only): no dense matmul may run; LinearPlan.build refuses one in this mode.
        return KernelChoice(DTYPE_NAMES[dtype], "native" if dtype == torch.float32 else "aten", {})

    def _block_choice(self, lib: ctypes.CDLL, fmt: str) -> tuple[str, bool]:
        """(dtype, whether invariance is cheap) for a GGUF model's block matmuls: measured by the block
        probe on rank 0, within what dtype float32 or $FORERUN_AUTO_DTYPES pins."""
        allowed = [DTYPE_NAMES[d] for d in auto_dtypes(os.environ)]
        if parse_dtype(self.config.dtype, self.device) == torch.float32:
            allowed = ["float32"]
        if "float32" not in allowed:  # bf16 pinned: its matmuls are batch-variant
            return allowed[0], False
        result = None
        if self.rank == 0:
            choice = choose_block_dtype(lib, self._workload(), fmt, cache_dir() / "cpu_probe.json")
            logger.info("GGUF %s matmuls: %s", fmt, choice.describe())
            if choice.dtype not in allowed:  # bf16 won but is not allowed: the fp32 candidates decide
                choice = decide({n: g for n, g in choice.gflops.items() if n.startswith("float32")})
            result = (choice.dtype, choice.invariant)
        return self._from_rank0(result)

    def _workload(self) -> Workload:
        """What the block probe times: this rank's matmuls and attention at a decode step and a prefill
        chunk of fixed sizes, so that the default mode does not move with the batch settings."""
        c, tp = self.hf_config, self.tp_size
        heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        attention = None
        if heads % tp == 0 and kv_heads % tp == 0 and shape_supported(heads // tp, kv_heads // tp, head_dim):
            attention = AttentionShape(heads // tp, kv_heads // tp, head_dim, c["num_hidden_layers"])
        return Workload(model_matmul_shapes(c, tp), model_matmul_shapes(c, tp, logits=False), DECODE_ROWS,
                        PREFILL_ROWS, attention)

    def _choose_kernels(self, dtypes: list[torch.dtype] | None = None) -> KernelChoice:
        """dtype and matmul kernel: fixed ones as given, `auto` measured on this CPU (rank 0 decides)."""
        fixed = parse_dtype(self.config.dtype, self.device)
        kernels = None if self.config.linear_kernel == "auto" else [self.config.linear_kernel]
        if self.device.type != "cpu":
            return KernelChoice(DTYPE_NAMES[fixed or torch.bfloat16], "aten", {})
        choice = None
        if self.rank == 0:
            choice = choose_kernels(model_matmul_shapes(self.hf_config, self.tp_size), self.decode_batch,
                                    dtypes or ([fixed] if fixed else auto_dtypes(os.environ)), kernels,
                                    cache_dir() / "cpu_probe.json", self.gemm)
            if choice.gflops:
                logger.info("CPU matmuls: %s", choice.describe())
        return self._from_rank0(choice)

    def _from_rank0(self, value: Any) -> Any:
        """Rank 0's value on every rank: every rank must run the same dtype, or the collectives mismatch."""
        if self.world_size > 1:
            box = [value if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            value = box[0]
        return value
