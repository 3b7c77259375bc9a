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
           "speculative_config")


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags. Every default is None so `EngineConfig`'s own defaults apply."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="model folder, .gguf file or default model name (default: the bundled SmolLM2)")
    g.add_argument("--dtype", default=None, help="weights/activations dtype: auto, float32, bfloat16, float16")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: model's)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse KV blocks of shared prompt prefixes (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts across steps (default: on)")
    g.add_argument("--prefill-decode-policy", default=None, choices=["mixed", "split", "prefill-first"],
                   help="what one step may hold: mixed (prefills and decodes under one budget, default), "
                        "split (one request's prefill chunk or every running decode) or prefill-first "
                        "(prefill batches first, decodes when no prefill waits)")
    g.add_argument("--split-interleave-steps", type=int, default=None,
                   help="split: at most N prefill steps in a row while decodes wait (default: 1)")
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="fcfs (default) or priority: a request's `priority` orders the queue (lower first) "
                        "and preemption takes the lowest-priority running request")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default: 1GiB)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides memory)")
    g.add_argument("--seed", type=int, default=None, help="engine seed")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule one step ahead of the model (default: on for generation)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="tensor-parallel ranks")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                   help="pipeline stages of contiguous layers (mp executor; ranks = stages x tensor-parallel)")
    g.add_argument("--distributed-executor-backend", default=None,
                   choices=["uni", "mp", "ray", "external_launcher"], help="how ranks are launched")
    g.add_argument("--runner", default=None, choices=["generate", "pooling"], help="model runner kind")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads of each worker")
    g.add_argument("--linear-kernel", default=None, choices=["auto", "aten", "mkldnn", "native"],
                   help="CPU matmul kernel: F.linear, oneDNN prepacked, or forerun's C GEMM (default: auto, "
                        "the fastest measured on this machine)")
    g.add_argument("--native-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: forerun's C kernels, built at first use (decode attention, fused norm and "
                        "activation, rotary, GEMM); default: on when they build, --no-native-kernels for "
                        "stock torch ops")
    g.add_argument("--speculative-config", default=None,
                   help='n-gram speculative decoding as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, '
                        '"disable_by_batch_size": 32}\'')
    g.add_argument("--gemv-max-rows", type=int, default=None,
                   help="CPU fp32: matmuls of up to this many rows read the weights as bf16 when that is "
                        "exact, halving the bytes a decode step reads (default: measured; 0 turns it off)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run every decode step layer by layer from Python; by default a CPU decode step of "
                        "as many rows as --gemv-max-rows runs all layers in one C call (same results)")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """An EngineConfig from parsed flags: only flags the user set override the config's defaults."""
    values = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    assert set(values) <= {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**values)
    config.validate()
    return config
