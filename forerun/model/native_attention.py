"""Decode attention in C (`native/decode_attention.c`, built by forerun.model.native_build).

Stock PyTorch attends decode rows by first gathering every sequence's K/V blocks into one padded
buffer, then calling SDPA: on a CPU that copy costs as much as the attention itself. The C kernel
reads the paged cache in place.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from forerun.model.attention import AttentionMetadata, TorchSDPABackend
from forerun.model.native_build import profiled

MAX_GROUP = 16  # query heads per KV head the kernel's stack buffers hold
MAX_HEADS = 256  # query heads in all


class NativeDecodeBackend(TorchSDPABackend):
    """Stock-PyTorch attention for prefill rows; decode rows go to the C kernel when it can run them
    (CPU, fp32 or bf16, contiguous cache, head_dim a multiple of 8, at most MAX_GROUP query heads
    per KV head and MAX_HEADS in all); anything else falls back to the stock path."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.kernels = {torch.float32: lib.decode_attention_f32, torch.bfloat16: lib.decode_attention_bf16}

    def _decode(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                window: int | None) -> Tensor:
        rows, heads, dim = q.shape
        _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
        kernel = self.kernels.get(q.dtype)
        if (kernel is None or q.device.type != "cpu" or kv_cache.dtype != q.dtype or not kv_cache.is_contiguous()
                or heads // kv_heads > MAX_GROUP or heads > MAX_HEADS or dim % 8 or q.stride(2) != 1
                or q.stride(1) != dim):
            return super()._decode(q, kv_cache, meta, scale, window)
        assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
        out = q.new_empty(rows, heads * dim)
        with profiled("forerun::decode_attention"):
            failed = kernel(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), meta.decode_blocks.data_ptr(),
                            meta.decode_len // block_size, meta.decode_seq_lens.data_ptr(), out.data_ptr(),
                            rows, heads, kv_heads, dim, num_blocks, block_size, window or 0, scale,
                            torch.get_num_threads(), meta.decode_len)
        if failed:
            raise RuntimeError(f"decode attention: the C kernel failed (code {failed})")
        return out
