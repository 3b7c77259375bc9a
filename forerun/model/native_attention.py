"""Decode attention in C, built at first use with the system compiler and called through ctypes.

Stock PyTorch attends decode rows by first gathering every sequence's K/V blocks into one padded
buffer, then calling SDPA: on a CPU that copy costs as much as the attention itself. The C kernel in
`native/decode_attention.c` reads the paged cache in place. It needs no torch headers, so it builds in
about a second (plain C, `-O3 -march=native -fopenmp`); the library is cached by source, flags and
CPU. When no compiler is found or the build fails, `load_native_kernels` returns None and the model
keeps the stock-PyTorch backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from forerun.model.attention import AttentionMetadata, TorchSDPABackend
from forerun.platform import cpu_signature

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "decode_attention.c"
# gnu11, not c11: strict ISO mode turns off FMA contraction, which halves the kernel's speed.
# -fno-math-errno lets `omp simd` vectorise expf; no -ffast-math, so the arithmetic stays IEEE.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]
MAX_GROUP = 16  # query heads per KV head the kernel's stack buffer holds
_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


def load_native_kernels(cache_root: Path) -> ctypes.CDLL | None:
    """The compiled kernel library (built into `cache_root` when absent), or None when it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: attention uses stock PyTorch ops")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha1(source + " ".join([compiler, *CFLAGS, cpu_signature()]).encode()).hexdigest()[:16]
    lib_path = cache_root / f"decode_attention-{key}.so"
    if not lib_path.is_file():
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([compiler, *CFLAGS, "-o", str(tmp), str(SOURCE), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            logger.warning("building the C attention kernel failed, using stock PyTorch ops:\n%s",
                           proc.stderr[-2000:])
            tmp.unlink(missing_ok=True)
            return None
        tmp.replace(lib_path)  # atomic: a concurrent start never loads half a file
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError as exc:
        logger.warning("loading %s failed (%s): attention uses stock PyTorch ops", lib_path, exc)
        return None
    for fn in (lib.decode_attention_f32, lib.decode_attention_bf16):
        fn.restype = _INT
        fn.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                       _F32, _INT, _I64]
    return lib


class NativeDecodeBackend(TorchSDPABackend):
    """Stock-PyTorch attention for prefill rows; decode rows go to the C kernel when it can run them
    (CPU, fp32 or bf16, contiguous cache, head_dim a multiple of 8, at most MAX_GROUP query heads
    per KV head); anything else falls back to the stock path."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.kernels = {torch.float32: lib.decode_attention_f32, torch.bfloat16: lib.decode_attention_bf16}

    def _decode(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, mask: Tensor | None,
                scale: float, window: int | None = None) -> Tensor:
        rows, heads, dim = q.shape
        _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
        kernel = self.kernels.get(q.dtype)
        if (kernel is None or q.device.type != "cpu" or kv_cache.dtype != q.dtype or not kv_cache.is_contiguous()
                or heads // kv_heads > MAX_GROUP or dim % 8 or q.stride(2) != 1 or q.stride(1) != dim):
            return super()._decode(q, kv_cache, meta, mask, scale, window)
        assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
        out = q.new_empty(rows, heads * dim)
        failed = kernel(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), meta.decode_blocks.data_ptr(),
                        meta.decode_len // block_size, meta.decode_seq_lens.data_ptr(), out.data_ptr(),
                        rows, heads, kv_heads, dim, num_blocks, block_size, window or 0, scale,
                        torch.get_num_threads(), meta.decode_len)
        if failed:
            raise RuntimeError(f"decode attention: the C kernel failed (code {failed})")
        return out
