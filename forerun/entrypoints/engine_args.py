"""Command-line flags for every `EngineConfig` field, shared by `serve`, `generate`, `chat` and `bench`."""

from __future__ import annotations

import argparse
import dataclasses

from forerun.config import EngineConfig

# Flags whose value maps one to one onto an EngineConfig field of the same name.
_FIELDS = ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
           "enable_prefix_caching", "enable_chunked_prefill", "prefill_decode_policy",
           "split_interleave_steps", "scheduling_policy", "kv_cache_memory", "num_kv_blocks",
           "async_scheduling", "seed", "tensor_parallel_size", "pipeline_parallel_size",
           "distributed_executor_backend", "runner",
           "num_threads", "linear_kernel", "native_kernels", "gemv_max_rows", "enforce_eager",
           "batch_invariant",
           "dense_weights", "activation_bits", "speculative_config")


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags. Every default is None so `EngineConfig`'s own defaults apply; the help shows
    those effective defaults (read from `EngineConfig`, so the two cannot drift apart)."""
    d = EngineConfig  # the dataclass's field defaults, read as class attributes
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="the model: a folder with config.json and safetensors weights, a .gguf file, or a default "
                        "model name (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=None,
                   help="data type of the weights and activations: auto, float32, bfloat16 or float16 (default: "
                        f"{d.dtype}: bfloat16 on CUDA; on CPU the faster of float32 and bfloat16, measured on this "
                        "machine)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length: the most tokens one request holds, prompt plus output (default: the "
                        "model's max_position_embeddings, lowered with a warning to what the KV cache holds)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"the most requests scheduled in one step (default: {d.max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the most tokens one step processes, prompt chunks and decodes together (default: "
                        f"{d.max_num_batched_tokens})")
    g.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV-cache block (default: {d.block_size})")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of prompt prefixes computed before (default: "
                        f"{_on_off(d.enable_prefix_caching)})")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="let a prompt larger than the step budget run in chunks over several steps; off, one step "
                        "must hold a whole sequence (default: "
                        f"{_on_off(d.enable_chunked_prefill)})")
    g.add_argument("--prefill-decode-policy", default=None, choices=["mixed", "split", "prefill-first"],
                   help="what one step may hold: mixed (prefills and decodes under one budget), "
                        "split (one request's prefill chunk or every running decode) or prefill-first "
                        "(prefill batches first, decodes when no prefill waits) "
                        f"(default: {d.prefill_decode_policy})")
    g.add_argument("--split-interleave-steps", type=int, default=None,
                   help="with --prefill-decode-policy split: at most N prefill steps in a row while decodes wait "
                        f"(default: {d.split_interleave_steps})")
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="fcfs (first come, first served) or priority: a request's `priority` orders the queue "
                        "(lower first, arrival breaks ties) and preemption takes the lowest-priority running "
                        f"request (default: {d.scheduling_policy})")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size of each rank, in bytes or with a unit, e.g. 2GiB or 512MiB (default: 1GiB, "
                        "capped at what --max-num-seqs requests of --max-model-len tokens can use; "
                        "ignored when --num-kv-blocks is given)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks of --block-size tokens; overrides --kv-cache-memory "
                        "(default: derived from --kv-cache-memory)")
    g.add_argument("--seed", type=int, default=None,
                   help="random seed of the engine; requests without their own seed sample from it "
                        f"(default: {d.seed})")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the model runs the current one, hiding the CPU's "
                        "scheduling time (default: on for --runner generate, off for --runner pooling)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="number of tensor-parallel ranks; each layer's weights are split across them "
                        f"(default: {d.tensor_parallel_size})")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                   help="number of pipeline stages, each holding a contiguous run of layers (mp or ray executor; "
                        f"ranks = stages x tensor-parallel size) (default: {d.pipeline_parallel_size})")
    g.add_argument("--distributed-executor-backend", default=None,
                   choices=["uni", "mp", "ray", "external_launcher"],
                   help="how the ranks run: uni (one rank, in this process), mp (one worker process per rank), "
                        "ray (Ray actors) or external_launcher (each process, started by e.g. torchrun, is one "
                        "rank) (default: uni for one rank, mp for more)")
    g.add_argument("--runner", default=None, choices=["generate", "pooling"],
                   help="what the model runs for: generate (text generation) or pooling (embeddings) "
                        f"(default: {d.runner})")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads of each worker (default: all cores for one rank; on CPU the mp "
                        "and ray executors share the cores among the ranks)")
    g.add_argument("--linear-kernel", default=None, choices=["auto", "aten", "mkldnn", "native"],
                   help="CPU matmul kernel: aten (F.linear), mkldnn (oneDNN, prepacked weights), native "
                        "(forerun's C GEMM) or auto, the fastest measured on this machine "
                        f"(default: {d.linear_kernel})")
    g.add_argument("--native-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: forerun's C kernels, built at first use (decode attention, fused norm and "
                        "activation, rotary, GEMM); --no-native-kernels for stock torch ops (default: on when "
                        "they build)")
    g.add_argument("--speculative-config", default=None,
                   help='n-gram (prompt lookup) speculative decoding as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, '
                        '"disable_by_batch_size": 32}\'; num_speculative_tokens is required (default: off)')
    g.add_argument("--gemv-max-rows", type=int, default=None,
                   help="CPU fp32: matmuls of up to this many rows read the weights as bf16 when that is "
                        "exact, halving the bytes a decode step reads; 0 turns it off (default: measured on "
                        "this machine)")
    g.add_argument("--dense-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU, GGUF files: also keep a dense copy of the quantized weights in the engine's dtype "
                        "for batched steps (more memory; faster where the block matmul is slower); otherwise "
                        f"only the file's blocks are held (default: {_on_off(d.dense_weights)})")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run every decode step layer by layer from Python; otherwise a CPU decode step of at "
                        "most --gemv-max-rows rows runs all layers in one C call, with the same results "
                        f"(default: {_on_off(d.enforce_eager)})")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: a request's tokens and logprobs do not depend on what else runs with it, on "
                        "chunked prefill or on prefix-cache hits (fp32; see docs/batch-invariance.md) (default: "
                        "on for GGUF files where the probe finds it within 5%% of the fastest batched matmuls "
                        "on this CPU, off elsewhere)")
    g.add_argument("--activation-bits", type=int, choices=(32, 16, 8), default=None,
                   help="CPU, GGUF matrices in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL or Q3_K..Q6_K: small "
                        "decode steps multiply each matmul's input in fp32 (32), or round it to 16 or 8 bits "
                        "per 32 values and multiply in integers (16: within about 2^-16 of fp32; 8: as "
                        "llama.cpp does, fastest, changes answers; see docs/cpu-kernels.md) (default: 16 with "
                        "--dtype auto where batch invariance is off and the probe finds it faster on this CPU, "
                        "else 32)")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An EngineConfig from parsed flags: only flags the user set override the config's defaults."""
    values = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    assert set(values) <= {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**values)
    config.validate()
    return config
