"""One rank: device and process-group setup, model loading, KV cache allocation, and step calls."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from forerun.config import EngineConfig, SpeculativeConfig
from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from forerun.heap import STEP_TRIM, fix_heap_thresholds
from forerun.kernels.build import load_native_library
from forerun.kernels.gemm import PackedGemm
from forerun.kernels.gemv import CompactGemv
from forerun.kernels.linear import LinearPlan, row_bucket
from forerun.kernels.ops import NativeOps
from forerun.kernels.block_linear import small_block_linear
from forerun.kernels.probe import (DTYPE_NAMES, KernelChoice, MatmulPair, choose_gemv_rows,
                                   dense_pair, measure)
from forerun.loader.model_source import cache_dir
from forerun.model.attention import NativeDecodeBackend
from forerun.model.bert import load_bert
from forerun.model.layers import PackableLinear
from forerun.model.parallel import TPGroup
from forerun.model.pooling import PoolingConfig
from forerun.model.registry import load_model, model_matmul_shapes
from forerun.platform import default_device, distributed_backend, parse_dtype
from forerun.model.weight_update import update_in_place
from forerun.worker.extension import run_user_call
from forerun.worker.model_runner import ModelRunner
from forerun.worker.numerics import NumericsChooser
from forerun.worker.pooling_runner import EncoderPoolingRunner, PoolingModelRunner
from forerun.worker.pp_runner import PipelineModelRunner
from forerun.worker.sleep import SleepState
from forerun.worker.stage_link import StageLink
from forerun.worker.zero_pages import zeros_tensor

logger = logging.getLogger(__name__)
# Batch-invariant mode in bf16: GGUF matmuls of up to this many rows run the ordered GEMV, larger ones the
# bf16 block matmul (the same sums). Measured on an avx512_bf16 Xeon, 2048 x 2048, 2 threads: at 1 and 4
# rows the GEMV took 0.35-0.6x the matmul's time in Q4_1, Q4_K, Q8_0 and Q6_K; at 8 rows 0.84-0.87x in
# the first three and 1.37x in Q6_K; at 16 rows 1.6-2.4x.
ORDERED_ROWS = 4

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_model_len: int
    num_layers: int
    encoder_only: bool = False


def is_encoder_model(hf_config: dict) -> bool:
    return any(a.startswith("Bert") for a in hf_config.get("architectures") or [])


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros, not empty: padded slots are read (and weighted by 0) and must never hold NaN.

    On CPU the cache is an anonymous memory map: fresh zero pages that the kernel fills on first
    touch, so a large KV cache costs nothing at start-up (torch.zeros would write every byte: about
    0.4 s per GiB here), and only the pages written are resident. The map asks for small pages: with
    transparent huge pages each layer's first tokens of K and of V would make 2 MiB resident apiece
    (SmolLM2 after 4 requests: 30 layers x ~4.5 MB, against ~0.3 MB of written KV a layer).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return zeros_tensor(shape, dtype, small_pages=True)


class Worker:
    """Owns one rank's model runner. Every method is safe to call through `collective_rpc`.

    Invariants: `init_kv_cache` runs once, after every rank agreed on the same block count; rank =
    pipeline stage * tensor_parallel_size + tensor-parallel rank, and the output rank (the one whose
    `sample_tokens` result the engine reads) is the last stage's tensor-parallel rank 0.
    """

    def __init__(self, config: EngineConfig, model_folder: Path, rank: int = 0, world_size: int = 1,
                 dist_init_method: str | None = None) -> None:
        self.config = config
        self.folder = Path(model_folder)
        self.rank = rank
        self.world_size = world_size
        self.device = default_device()
        if self.device.type == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            fix_heap_thresholds()  # before loading: the weights' first copies are then given back
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(distributed_backend(self.device), init_method=dist_init_method,
                                    rank=rank, world_size=world_size)
        torch.manual_seed(config.seed)
        tp_size, self.pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        if world_size != tp_size * self.pp_size:
            raise ValueError(f"tensor_parallel_size: {tp_size} x pipeline_parallel_size {self.pp_size} "
                             f"does not match the {world_size} ranks started")
        self.stage, tp_rank = divmod(rank, tp_size)
        self.output_rank = world_size - tp_size
        self.tp = TPGroup(tp_rank, tp_size, self._tp_group(tp_size))  # ordered: set once the mode is chosen
        self.hf_config = json.loads((self.folder / "config.json").read_text())
        self.encoder_only = config.runner == "pooling" and is_encoder_model(self.hf_config)
        self.gemm: PackedGemm | None = None
        self.native_ops: NativeOps | None = None
        if self.encoder_only:
            if world_size > 1:
                raise ValueError("tensor_parallel_size: encoder (embedding) models run on one rank")
            if config.batch_invariant:
                raise ValueError("batch_invariant: not built for encoder (embedding) models; they run stock ops")
            self.batch_invariant = False
            self.dtype = parse_dtype(config.dtype, self.device) or torch.float32
            self.kernel_choice = KernelChoice(DTYPE_NAMES[self.dtype], "aten", {})
            self.model = load_bert(self.folder, self.dtype, self.device)
        else:
            lib = self._native_library()
            if lib is not None:
                self.gemm = PackedGemm(lib)
            numerics = NumericsChooser(config, self.hf_config, self.folder, self.device, rank, world_size,
                                       tp_size, self._decode_batch(), self.gemm).choose(lib)
            invariant = self.batch_invariant = numerics.invariant
            self.tp = dataclasses.replace(self.tp, ordered=invariant)
            self.kernel_choice = choice = numerics.choice
            self.dtype = choice.torch_dtype
            if rank == 0:
                logger.info("batch invariance: %s", "on" if invariant else "off")
            gemv = None if lib is None else CompactGemv(lib)
            # bf16 invariance pairs the bf16 block matmul with a GEMV of its order; fp32 keeps the block
            # GEMV, whose order the lane matmul shares, so its row crossover is measured as usual.
            ordered = ORDERED_ROWS if invariant and self.dtype == torch.bfloat16 else 0
            # GGUF blocks are read by the C kernels only; elsewhere (CUDA, no compiler) they are expanded.
            self.model = load_model(self.folder, self.dtype, self.device, self.tp,
                                    None if lib is None else NativeDecodeBackend(lib, invariant), self.stage,
                                    self.pp_size, keep_blocks=lib is not None, load_format=config.load_format)
            if lib is not None:
                self.native_ops = NativeOps(lib)
                self.model.use_native_ops(self.native_ops)
            plan = LinearPlan(choice.linear_kernel, self._decode_batch(), gemv, 0, self.gemm, lib,
                              config.dense_weights, ordered, activation_bits=numerics.activation_bits,
                              invariant=invariant)
            gemv_rows = 0 if ordered else self._choose_gemv_rows(choice, plan)
            if choice.linear_kernel != "aten" or gemv_rows or self.model.holds_blocks():
                on_gemv, total = self.model.use_linear_kernel(dataclasses.replace(plan, gemv_rows=gemv_rows))
                if gemv_rows and self.rank == 0:
                    logger.info("matmuls of up to %d rows read compact weights in %s arithmetic (%d of %d "
                                "matmuls have an exact compact form)", gemv_rows,
                                "fp32" if plan.activation_bits == 32
                                else f"int{plan.activation_bits} (GGUF formats with that GEMV) or fp32",
                                on_gemv, total)
            # Batch-invariant mode keeps the one-call step in fp32 only: it runs fp32 between ops, which
            # the module path matches in fp32 (bit for bit), but not in bf16 (it rounds after each op).
            fused_ok = not invariant or self.dtype == torch.float32
            small_rows = dataclasses.replace(plan, gemv_rows=gemv_rows).small_rows
            if lib is not None and small_rows and fused_ok and not config.enforce_eager:
                why_not = self.model.use_decode_layers(lib, split=not invariant)
                if self.rank == 0:
                    logger.info("decode steps of up to %d rows: %s", small_rows,
                                f"layer by layer ({why_not})" if why_not else "all layers in one C call")
        self.runner: ModelRunner | None = None
        self._profiler: torch.profiler.profile | None = None
        self.sleep_state = SleepState()

    def _tp_group(self, tp_size: int):
        """This stage's tensor-parallel process group (None: the default group, when there are no stages).
        Every rank creates every stage's group, in the same order, as torch.distributed requires."""
        if self.pp_size == 1 or tp_size == 1:
            return None
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(self.pp_size)]
        return groups[self.stage]

    def _native_library(self) -> ctypes.CDLL | None:
        """forerun's C kernels on CPU unless turned off; None (stock torch ops) when they won't build."""
        want = self.config.native_kernels
        if want is False or self.device.type != "cpu":
            if want:
                raise ValueError("native_kernels: the C kernels run on CPU only")
            return None
        lib = load_native_library(cache_dir() / "kernels")
        if lib is None and want:
            raise ValueError("native_kernels: the C kernels could not be built (see the log)")
        return lib

    def _decode_batch(self) -> int:
        """The batch size the matmul choice is tuned for: a full decode step, capped where GEMMs saturate."""
        return min(self.config.max_num_seqs, 64)

    def _choose_gemv_rows(self, choice: KernelChoice, plan: LinearPlan) -> int:
        """Up to how many rows matmuls read compact weights with a GEMV (a bf16 engine's activations
        convert to fp32 at the kernel): as configured, or measured on this CPU for the model's compact
        format, against `plan`'s batched matmul (the chosen kernel over dense weights; for GGUF blocks
        the block matmul or the dense copy); rank 0 decides. 0 where it cannot apply."""
        want = self.config.gemv_max_rows
        fmt = self.model.compact_format()
        usable = plan.gemv is not None and choice.torch_dtype in (torch.float32, torch.bfloat16) and fmt is not None
        # Batch-invariant mode reads dense matrices with one kernel at every row count (LinearPlan.build).
        usable = usable and (not plan.invariant or self.model.holds_blocks())
        if want is not None:  # the same on every rank: no collective needed
            return want if usable else 0
        rows = 0
        if self.rank == 0 and usable:
            assert plan.gemv is not None and fmt is not None
            dtype = choice.torch_dtype
            if self.model.holds_blocks():
                pair: MatmulPair = lambda w: (  # noqa: E731
                    small_block_linear(plan.lib, w, None, False, plan.activation_bits),
                    plan.build_blocks([w], None, dtype).matmul)
                key = [plan.gemv.build, "blocks", plan.dense_copy, choice.linear_kernel]
                key += [f"int{plan.activation_bits}"] if plan.activation_bits != 32 else []
            else:
                pair, key = dense_pair(choice.linear_kernel, plan.gemv, dtype, self.gemm), [plan.gemv.build,
                                                                                             choice.linear_kernel]
            rows, speedup = choose_gemv_rows(model_matmul_shapes(self.hf_config, self.tp.size), pair, fmt,
                                             self._decode_batch(), cache_dir() / "cpu_probe.json", key, dtype)
            against = "the block matmul" if self.model.holds_blocks() and not plan.dense_copy else choice.linear_kernel
            logger.info("%s-weight GEMV vs %s %s, speed-up by rows: %s", fmt, choice.dtype, against,
                        ", ".join(f"{r}: {v:.2f}x" for r, v in sorted(speedup.items())) or "not measured")
        if self.world_size > 1:  # every rank joins, whatever it found locally
            box = [rows]
            dist.broadcast_object_list(box, src=0)
            rows = box[0]
        return rows if usable else 0

    def model_info(self) -> ModelInfo:
        cfg = self.hf_config
        if self.encoder_only:
            return ModelInfo(int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 512)),
                             int(cfg["num_hidden_layers"]), encoder_only=True)
        limit = self.model.max_position  # model_positions of the config (forerun.model.positions)
        return ModelInfo(self.model.vocab_size, limit, self.model.num_layers)

    def bytes_per_block(self) -> int:
        shape = self.model.kv_cache_shape(1, self.config.block_size)
        return len(self.model.local_layers) * int(torch.Size(shape).numel()) * self.dtype.itemsize

    def determine_num_blocks(self, max_model_len: int) -> int:
        """Blocks this rank can hold; never more than the batch could ever use (0 for encoders)."""
        cfg = self.config
        if self.encoder_only:
            return 0
        per_seq = -(-max_model_len // cfg.block_size)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        budget = int(cfg.kv_cache_memory or DEFAULT_KV_CACHE_BYTES)
        n = budget // self.bytes_per_block()
        return int(min(n, per_seq * cfg.max_num_seqs))

    def init_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        caches: list[torch.Tensor] = []
        if not self.encoder_only:
            self.model.limit_positions(max_model_len)
            shape = self.model.kv_cache_shape(num_blocks, self.config.block_size)
            caches = [_zeros(shape, self.dtype, self.device) for _ in self.model.local_layers]
        args = (self.model, caches, self.config.block_size, self.config.max_num_seqs, max_model_len,
                int(self.hf_config.get("vocab_size", 0)), self.device, self.native_ops)
        if self.config.runner == "pooling":
            pooling = PoolingConfig.from_folder(self.folder, default="last")
            cls = EncoderPoolingRunner if self.encoder_only else PoolingModelRunner
            self.runner = cls(*args, pooling=pooling)
        elif self.pp_size > 1:
            link = StageLink(self.stage, self.pp_size, self.tp.rank, self.tp.size, self.device)
            self.runner = PipelineModelRunner(*args, link=link, rank=self.rank,
                                              hidden_size=int(self.hf_config["hidden_size"]),
                                              act_dtype=self.dtype, share_timing=self.config.trace)
        else:
            self.runner = ModelRunner(*args, spec=SpeculativeConfig.from_value(self.config.speculative_config))
        # Sampling without a per-request seed draws from torch's global RNG, and every tensor-parallel rank
        # must draw the same numbers (each feeds its own sampled token to the next step). Seeding again
        # now, after all setup, makes the stream independent of whatever ran on one rank or one start only.
        torch.manual_seed(self.config.seed)
        if self.device.type == "cpu":
            fix_heap_thresholds(STEP_TRIM)  # built: keep each step's temporaries between steps
        logger.info("rank %d: KV cache of %d blocks x %d tokens", self.rank, num_blocks, self.config.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        assert self.runner is not None
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        assert self.runner is not None
        out = self.runner.sample_tokens(grammar_output)
        return out if self.rank == self.output_rank else None

    def touch_kv_cache(self) -> None:
        """Write every page of the KV cache once. It is allocated as untouched zero pages (free at start),
        and each page then costs a fault on its first use (0.33 s per 128 MiB measured here); a server
        that has run a while has touched them all. Benchmarks call this to measure that state."""
        assert self.runner is not None
        for cache in getattr(self.runner, "kv_caches", ()):
            cache.zero_()

    def warm_matmuls(self, max_rows: int) -> int:
        """Run each distinct dense matmul shape of the model once at every row count a step of up to
        `max_rows` rows runs it at (forerun.kernels.linear.row_bucket); returns the number of calls.
        oneDNN compiles a kernel per shape at its first use (1.5-2 ms each, forerun.kernels.linear), so
        a benchmark's first timed run in a process would compile them inside its steps while the
        forward-only replay after it found them compiled (the tiny model: 240 calls, 0.34 s)."""
        assert self.runner is not None
        shapes: dict[tuple[int, ...], PackableLinear] = {}
        for module in self.model.modules():
            if isinstance(module, PackableLinear) and module.blocks is None:
                shape = module.dense_shape or tuple(module.weight.shape)
                if len(shape) == 2 and shape[1] > 0:
                    shapes.setdefault(shape, module)
        rows = sorted({row_bucket(n) for n in range(1, max_rows + 1)})
        with torch.inference_mode():
            for shape, module in shapes.items():
                for n in rows:
                    module.matmul(torch.zeros(n, shape[1], dtype=self.dtype, device=self.device))
        return len(shapes) * len(rows)

    def matmul_peak_gflops(self) -> float:
        """GFLOPS of this rank's matmuls at the model's decode shapes with the dtype and kernel in use,
        measured now: the limit one forward step can reach, taken in the same run as the figure it bounds."""
        choice = self.kernel_choice
        shapes = model_matmul_shapes(self.hf_config, self.tp.size)
        return measure(shapes, self._decode_batch(), [(choice.torch_dtype, choice.linear_kernel)], gemm=self.gemm)[
            f"{choice.dtype}/{choice.linear_kernel}"]

    def start_profile(self) -> None:
        """Profile this thread's torch ops (the profiler sees only the thread that starts it)."""
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profiler.__enter__()

    def stop_profile(self, row_limit: int = 25) -> list[dict]:
        """The top operators by self CPU time since `start_profile`."""
        assert self._profiler is not None, "stop_profile without start_profile"
        self._profiler.__exit__(None, None, None)
        events = sorted(self._profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:row_limit]
        self._profiler = None
        return [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count}
                for e in events]

    def ping(self) -> int:
        return os.getpid()

    # ---- RL trainers' calls (vLLM's names): forerun.worker.extension, forerun.model.weight_update, sleep
    def user_call(self, target: str | bytes | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A trainer's `collective_rpc`: a method by name or a callable; its error comes back as a value."""
        return run_user_call(self, target, args, kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Update this rank's shard of the named Hugging Face tensors in place; the names applied here."""
        self.sleep_state.check_awake("load_weights", "weights")
        if self.encoder_only:
            raise ValueError("load_weights: not built for encoder (embedding) models")
        return update_in_place(self.model, weights)

    def sleep(self, level: int = 1) -> int:
        """Give the KV cache's memory (and the weights' at level 2) back to the OS; the bytes freed."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep: needs an engine started with enable_sleep_mode=True")
        return self.sleep_state.sleep(level, self.model, self._kv_caches(),
                                      not self.encoder_only and self.model.holds_blocks())

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_state.wake_up(tags, self.model, self._kv_caches())

    def _kv_caches(self) -> list[torch.Tensor]:
        return list(getattr(self.runner, "kv_caches", ()))

    def shutdown(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
