"""Decode attention in C (`csrc/decode_attention.c`, built by forerun.kernels.build).

Stock PyTorch attends decode rows by first gathering every sequence's K/V blocks into one padded
buffer, then calling SDPA: on a CPU that copy costs as much as the attention itself. The C kernel
reads the paged cache in place. The model's paged-attention backend
(forerun.model.attention.NativeDecodeBackend) asks `DecodeAttention.accepts` and falls back to its
stock path where the kernel cannot run.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
from torch import Tensor

from forerun.kernels.build import profiled
from forerun.kernels.types import DecodeBatch

MAX_GROUP = 16  # query heads per KV head the kernel's stack buffers hold
MAX_HEADS = 256  # query heads in all


def shape_supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel's buffers hold this attention shape."""
    return heads // kv_heads <= MAX_GROUP and heads <= MAX_HEADS and head_dim % 8 == 0


class DecodeAttention:
    """The C decode-attention kernels by dtype (fp32, bf16). Invariant: `kernels` maps a dtype to a
    callable with the C signature; tests may wrap them, and `__call__` looks them up at each call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.kernels: dict[torch.dtype, Callable[..., int]] = {
            torch.float32: lib.decode_attention_f32, torch.bfloat16: lib.decode_attention_bf16}

    def accepts(self, q: Tensor, kv_cache: Tensor) -> bool:
        """Whether the kernel runs these decode rows: CPU, fp32 or bf16 (cache in the same dtype,
        contiguous), head_dim a multiple of 8, at most MAX_GROUP query heads per KV head and MAX_HEADS
        in all, q rows with unit-stride heads."""
        _, heads, dim = q.shape
        kv_heads = kv_cache.shape[3]
        return (q.dtype in self.kernels and q.device.type == "cpu" and kv_cache.dtype == q.dtype
                and kv_cache.is_contiguous() and shape_supported(heads, kv_heads, dim)
                and q.stride(2) == 1 and q.stride(1) == dim)

    def __call__(self, q: Tensor, kv_cache: Tensor, meta: DecodeBatch, scale: float, window: int | None,
                 split: bool = True) -> Tensor:
        """Decode rows q [rows, heads, dim] attended over the paged `kv_cache` -> [rows, heads * dim];
        only for inputs `accepts` takes. `split` False: each row's context is cut into parts by its own
        length alone, so its result does not depend on the other rows or the thread count
        (batch-invariant mode); True: the parts also depend on the batch, to keep every thread busy."""
        rows, heads, dim = q.shape
        _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
        kernel = self.kernels[q.dtype]
        assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
        out = q.new_empty(rows, heads * dim)
        with profiled("forerun::decode_attention"):
            failed = kernel(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), meta.decode_blocks.data_ptr(),
                            meta.decode_len // block_size, meta.decode_seq_lens.data_ptr(), out.data_ptr(),
                            rows, heads, kv_heads, dim, num_blocks, block_size, window or 0, scale,
                            torch.get_num_threads(), meta.decode_len, int(split))
        if failed:
            raise RuntimeError(f"decode attention: the C kernel failed (code {failed})")
        return out
