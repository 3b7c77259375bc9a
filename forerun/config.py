"""One typed configuration tree for an engine, validated once with errors that name the field."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from forerun.core.request_queue import SchedulingPolicy, validate_scheduling_policy
from forerun.core.step_policy import PrefillDecodePolicy, validate_policy
from forerun.model.positions import model_positions

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


@dataclass(frozen=True)
class SpeculativeConfig:
    """N-gram (prompt lookup) speculative decoding, with vLLM's names.

    Invariants (after `from_value`): 1 <= prompt_lookup_min <= prompt_lookup_max; a decode proposes at
    most `num_speculative_tokens` drafts; `disable_by_batch_size` None means never turned off.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None  # no drafts in a step whose running batch is larger than this

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """A dict (as `LLM(speculative_config=...)`), a JSON string (as the CLI) or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: expected a dict or a JSON object, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown option; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        method = value.get("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative_config.method: only 'ngram' is supported, got {method!r}")
        values = dict(value)
        # As vLLM: one bound given means both take it.
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lo is None and hi is not None:
            values["prompt_lookup_min"] = min(hi, cls.prompt_lookup_min)
        if hi is None and lo is not None:
            values["prompt_lookup_max"] = max(lo, cls.prompt_lookup_max)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _positive(values.get(name, getattr(cls, name)), f"speculative_config.{name}")
        if values.get("disable_by_batch_size") is not None:
            _positive(values["disable_by_batch_size"], "speculative_config.disable_by_batch_size")
        cfg = cls(**values)
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: {cfg.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max {cfg.prompt_lookup_max}")
        return cfg


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
    linear_kernel: str = "auto"  # CPU matmuls: auto (measured), aten (F.linear), mkldnn (prepacked) or native (C)
    native_kernels: bool | None = None  # forerun's C kernels on CPU (attention, fused ops); None: when they build
    gemv_max_rows: int | None = None  # fp32 matmuls of up to this many rows read compact weights; None: measured
    enforce_eager: bool = False  # True: small decode steps run layer by layer in Python, not in one C call
    # True (CPU): every row's result is computed in an order that does not depend on the rest of the
    # batch, on chunking or on prefix-cache hits (fp32, one order of sums at every row count, attention
    # of every token on one C kernel); docs/batch-invariance.md says what it costs. None: on for GGUF
    # files on CPU where the probe finds it costs at most 5% of the batched throughput, off elsewhere.
    batch_invariant: bool | None = None
    # GGUF quantized matrices: False keeps only the file's blocks; True adds a dense copy in the engine's
    # dtype for batched steps (more memory, faster where the block matmul is slower).
    dense_weights: bool = False
    # GGUF files (Q4_0..Q8_0, IQ4_NL, Q3_K..Q6_K): the input of each small-batch matmul in fp32 (32), or
    # rounded to 16 or 8 bits per 32 values and multiplied in integers (8: as llama.cpp does; changes
    # answers). None: 16 where dtype "auto" is measured, batch invariance is off and the probe finds it
    # faster; else 32.
    activation_bits: int | None = None
    trace: bool = False  # record the step timeline
    # N-gram speculative decoding: a SpeculativeConfig, a dict of its fields or a JSON string; None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # RL rollouts (vLLM's names): "module.Class" mixed into every worker, so `collective_rpc` can call
    # its methods by name; sleep/wake_up allowed; "dummy" starts from random weights of the model's
    # shapes (a trainer pushes its own with load_weights right after start).
    worker_extension_cls: str | None = None
    enable_sleep_mode: bool = False
    load_format: str = "auto"
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
        if self.max_model_len is not None:
            self._check_batch_holds_prompt(self.max_model_len)
        if self.num_threads is not None:
            _positive(self.num_threads, "num_threads")
        if self.native_kernels not in (None, True, False):
            raise ValueError(f"native_kernels: expected a bool or None, got {self.native_kernels!r}")
        if not isinstance(self.dense_weights, bool):
            raise ValueError(f"dense_weights: expected a bool, got {self.dense_weights!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager: expected a bool, got {self.enforce_eager!r}")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant: expected a bool or None, got {self.batch_invariant!r}")
        if self.activation_bits is not None and (isinstance(self.activation_bits, bool)
                                                 or self.activation_bits not in (32, 16, 8)):
            raise ValueError(f"activation_bits: expected 32, 16, 8 or None, got {self.activation_bits!r}")
        if self.batch_invariant and self.activation_bits in (16, 8):
            raise ValueError("activation_bits: batch_invariant runs one matmul kernel for every row count, in "
                             "fp32; integer activations apply to small batches only")
        if self.batch_invariant and (self.gemv_max_rows is not None or self.dense_weights):
            raise ValueError("batch_invariant: chooses its own matmuls; gemv_max_rows and dense_weights do not "
                             "apply with it")
        if self.batch_invariant and self.linear_kernel not in ("auto", "native"):
            raise ValueError(f"batch_invariant: runs every matmul on forerun's own kernel; linear_kernel "
                             f"{self.linear_kernel!r} is batch-variant (use auto or native)")
        if self.gemv_max_rows is not None and (not isinstance(self.gemv_max_rows, int)
                                               or isinstance(self.gemv_max_rows, bool) or self.gemv_max_rows < 0):
            raise ValueError(f"gemv_max_rows: expected a non-negative integer or None, got {self.gemv_max_rows!r}")
        if self.linear_kernel not in ("auto", "aten", "mkldnn", "native"):
            raise ValueError(f"linear_kernel: expected auto, aten, mkldnn or native, got {self.linear_kernel!r}")
        self._validate_rl_options()
        validate_policy(self.prefill_decode_policy, self.split_interleave_steps)
        validate_scheduling_policy(self.scheduling_policy)
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if self.speculative_config is not None and self.runner == "pooling":
            raise ValueError("speculative_config: pooling models generate no tokens to speculate on")
        if self.speculative_config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config: not supported with pipeline_parallel_size > 1 yet")
        self.resolve_async_scheduling()

    def _validate_rl_options(self) -> None:
        """The options RL trainers set (worker_extension_cls, enable_sleep_mode, load_format)."""
        ext = self.worker_extension_cls
        if ext is not None and (not isinstance(ext, str) or "." not in ext.strip(".")):
            raise ValueError(f"worker_extension_cls: expected a 'module.Class' name, got {ext!r}")
        if not isinstance(self.enable_sleep_mode, bool):
            raise ValueError(f"enable_sleep_mode: expected a bool, got {self.enable_sleep_mode!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: expected 'auto' or 'dummy', got {self.load_format!r}")

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

    def _check_batch_holds_prompt(self, max_model_len: int) -> None:
        """Without chunked prefill a prompt (or a preempted request's prompt plus outputs) runs in one
        step, so one step's budget must hold a whole sequence; otherwise such a request waits forever."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens: {self.max_num_batched_tokens} is less than max_model_len "
                             f"{max_model_len}; with chunked prefill off one step must hold a whole sequence: "
                             "raise max_num_batched_tokens, lower max_model_len or turn enable_chunked_prefill on")

    def check_model(self, hf_config: dict[str, Any]) -> None:
        """Check this config against the model's config.json, before any worker starts.

        Tensor-parallel ranks split attention heads, key/value heads and the MLP evenly, and pipeline
        stages need a layer each; a model that cannot be split so is refused here, naming both fields,
        instead of failing in every worker. A `max_model_len` beyond the model's positions is refused too.
        """
        tp = self.tensor_parallel_size
        if tp > 1:
            heads = hf_config.get("num_attention_heads")
            for name, value in (("num_attention_heads", heads),
                                ("num_key_value_heads", hf_config.get("num_key_value_heads") or heads),
                                ("intermediate_size", hf_config.get("intermediate_size"))):
                if isinstance(value, int) and value % tp:
                    raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's {name} ({value}); "
                                     f"use a tensor_parallel_size that divides {value}")
        layers = hf_config.get("num_hidden_layers")
        if self.pipeline_parallel_size > 1 and isinstance(layers, int) and self.pipeline_parallel_size > layers:
            raise ValueError(f"pipeline_parallel_size: {self.pipeline_parallel_size} stages for {layers} layers; "
                             "every stage needs at least one layer")
        limit = model_positions(hf_config)
        if limit is not None:
            self.check_max_model_len(limit)

    def check_max_model_len(self, model_limit: int) -> int:
        """The max_model_len the engine will use before the KV cache is sized: the one asked for, or the
        model's own limit; raises ValueError for one beyond the model's limit or one step's budget."""
        if self.max_model_len is not None and self.max_model_len > model_limit:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's limit {model_limit}")
        max_model_len = self.max_model_len or model_limit
        self._check_batch_holds_prompt(max_model_len)
        return max_model_len

    def fit_max_model_len(self, max_model_len: int, num_kv_blocks: int) -> int:
        """The max_model_len that one sequence can fill in a KV cache of `num_kv_blocks` blocks.

        A request longer than the whole cache can never be admitted and would stall every request behind
        it. An explicit `max_model_len` the cache cannot hold is refused (ValueError naming the numbers and
        the fields to change); an unset one is lowered to what the cache holds, with a warning, so a small
        cache still serves (shorter) requests. `num_kv_blocks` 0 means no KV cache (encoder models).
        """
        if num_kv_blocks <= 0:
            return max_model_len
        capacity = num_kv_blocks * self.block_size
        if capacity >= max_model_len:
            return max_model_len
        if self.max_model_len is not None:
            raise ValueError(
                f"max_model_len: {max_model_len} tokens do not fit in the KV cache, which holds {capacity} tokens "
                f"({num_kv_blocks} blocks of {self.block_size}); raise kv_cache_memory or num_kv_blocks, or lower "
                f"max_model_len to at most {capacity}")
        logger.warning("max_model_len: the KV cache holds %d tokens (%d blocks of %d), less than the model's %d; "
                       "serving with max_model_len=%d (raise kv_cache_memory or num_kv_blocks for more)",
                       capacity, num_kv_blocks, self.block_size, max_model_len, capacity)
        return capacity

    @property
    def spec(self) -> SpeculativeConfig | None:
        """The validated speculative config (call after `validate`)."""
        assert not isinstance(self.speculative_config, (dict, str))
        return self.speculative_config

    def resolve_async_scheduling(self) -> None:
        """Async scheduling is on by default for generation and off for pooling, where no decode overlaps."""
        if self.async_scheduling is None:
            self.async_scheduling = self.runner == "generate"
            if self.runner == "pooling":
                logger.info("Async scheduling is off by default for pooling models (nothing to overlap).")


def _positive(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
