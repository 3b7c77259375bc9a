"""One typed configuration tree for an engine, validated once with errors that name the field."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Literal

from forerun.core.request_queue import SchedulingPolicy, validate_scheduling_policy
from forerun.core.step_policy import PrefillDecodePolicy, validate_policy

logger = logging.getLogger(__name__)

ExecutorBackend = Literal["uni", "mp", "ray", "external_launcher"]
Runner = Literal["generate", "pooling"]

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
               "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(value: str | int, name: str = "kv_cache_memory") -> int:
    """'2GiB' / '512MiB' / '1e9' / 123 -> bytes."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{name}: cannot parse size {value!r}; use e.g. 2GiB or 512MiB")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name}: must be positive, got {value!r}")
    return n


@dataclass
class EngineConfig:
    """Everything an engine needs to start. After `validate()` the values are consistent."""

    model: str | None = None  # None: the bundled default model
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    prefill_decode_policy: PrefillDecodePolicy = "mixed"  # mixed (one budget), split (Spyre) or prefill-first (SGLang)
    split_interleave_steps: int = 1  # split: most prefill steps in a row while decodes wait
    scheduling_policy: SchedulingPolicy = "fcfs"  # fcfs, or priority (per request; lower runs first)
    kv_cache_memory: int | str | None = None  # bytes; default 1 GiB when num_kv_blocks is not set
    num_kv_blocks: int | None = None
    async_scheduling: bool | None = None  # None: on for generation, off for pooling
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # contiguous layer stages; world size = pipeline x tensor parallel
    distributed_executor_backend: ExecutorBackend | None = None
    runner: Runner = "generate"
    num_threads: int | None = None  # torch intra-op threads of the worker; None: all cores
    linear_kernel: str = "auto"  # CPU matmuls: auto (measured), aten (F.linear) or mkldnn (prepacked)
    native_kernels: bool | None = None  # forerun's C kernels on CPU (attention, fused ops); None: when they build
    gemv_max_rows: int | None = None  # fp32 matmuls of up to this many rows read compact weights; None: measured
    trace: bool = False  # record the step timeline
    extra: dict[str, object] = field(default_factory=dict)

    def validate(self) -> None:
        _positive(self.max_num_seqs, "max_num_seqs")
        _positive(self.max_num_batched_tokens, "max_num_batched_tokens")
        _positive(self.block_size, "block_size")
        _positive(self.tensor_parallel_size, "tensor_parallel_size")
        _positive(self.pipeline_parallel_size, "pipeline_parallel_size")
        if self.max_model_len is not None:
            _positive(self.max_model_len, "max_model_len")
        if self.num_kv_blocks is not None:
            _positive(self.num_kv_blocks, "num_kv_blocks")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner: expected 'generate' or 'pooling', got {self.runner!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in ("uni", "mp", "ray", "external_launcher"):
            raise ValueError("distributed_executor_backend: expected uni, mp, ray or external_launcher, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend: 'uni' runs one rank; use mp, ray or "
                             f"external_launcher for tensor_parallel_size={self.tensor_parallel_size}")
        self._validate_pipeline()
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens: must be >= max_model_len when chunked prefill is off")
        if self.num_threads is not None:
            _positive(self.num_threads, "num_threads")
        if self.native_kernels not in (None, True, False):
            raise ValueError(f"native_kernels: expected a bool or None, got {self.native_kernels!r}")
        if self.gemv_max_rows is not None and (not isinstance(self.gemv_max_rows, int)
                                               or isinstance(self.gemv_max_rows, bool) or self.gemv_max_rows < 0):
            raise ValueError(f"gemv_max_rows: expected a non-negative integer or None, got {self.gemv_max_rows!r}")
        if self.linear_kernel not in ("auto", "aten", "mkldnn"):
            raise ValueError(f"linear_kernel: expected auto, aten or mkldnn, got {self.linear_kernel!r}")
        validate_policy(self.prefill_decode_policy, self.split_interleave_steps)
        validate_scheduling_policy(self.scheduling_policy)
        self.resolve_async_scheduling()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _validate_pipeline(self) -> None:
        """Pipeline stages run on `mp` or `ray` workers, and for generation only (the stage count against
        the model's layer count is checked by the executor, which reads the model's config)."""
        if self.pipeline_parallel_size == 1:
            return
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"pipeline_parallel_size: {self.pipeline_parallel_size} needs the mp or ray executor, "
                             f"not {self.distributed_executor_backend!r}")
        if self.runner != "generate":
            raise ValueError("pipeline_parallel_size: pipeline stages serve generation models only")

    def resolve_async_scheduling(self) -> None:
        """Async scheduling is on by default for generation and off for pooling, where no decode overlaps."""
        if self.async_scheduling is None:
            self.async_scheduling = self.runner == "generate"
            if self.runner == "pooling":
                logger.info("Async scheduling is off by default for pooling models (nothing to overlap).")


def _positive(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
