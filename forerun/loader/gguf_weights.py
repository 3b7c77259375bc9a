"""A GGUF file's tensors as the model loads them: float tensors as torch tensors, quantized matrices as
their own blocks (forerun.kernels.compact_weights.CompactWeight), never expanded.

Each tensor is read once, in its stored format, into memory of its own, so the loaded model holds
about the file's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import torch
from torch import Tensor

from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.formats import QUANT_FORMATS, QuantFormat
from forerun.loader.gguf_index import TensorEntry, read_index
from forerun.loader.gguf_tensors import ROPE_FREQS, hf_tensor_name, unpermute_rotary_rows

FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def rotary_heads(name: str, config: dict[str, Any]) -> int | None:
    """Heads of a q/k projection whose rows llama.cpp interleaved (Llama only), else None."""
    if config["model_type"] != "llama":
        return None
    if name.endswith("q_proj.weight"):
        return int(config["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return int(config["num_key_value_heads"])
    return None


_BY_TYPE = {f.ggml_type: f for f in QUANT_FORMATS.values()}


def _format(entry: TensorEntry) -> QuantFormat:
    fmt = _BY_TYPE.get(entry.ggml_type)
    if fmt is None:
        from gguf import GGMLQuantizationType  # only to name the type; importing gguf takes 0.2 s
        try:
            type_name = GGMLQuantizationType(entry.ggml_type).name
        except ValueError:
            type_name = f"number {entry.ggml_type}"
        raise ValueError(f"gguf: unsupported quant type {type_name} in tensor {entry.name}; "
                         f"supported: {', '.join(sorted(QUANT_FORMATS))}")
    return fmt


def main_quant_format(path: Path) -> str | None:
    """The quantized format that holds the most weights of the file's matrices (what its matmuls mostly
    read; a K-quant mix names its main type), or None when every matrix is a float type."""
    counts: dict[str, int] = {}
    for entry in read_index(path):
        fmt = _BY_TYPE.get(entry.ggml_type)
        if fmt is not None and fmt.name not in FLOAT_TYPES and len(entry.dims) == 2:
            counts[fmt.name] = counts.get(fmt.name, 0) + entry.dims[0] * entry.dims[1]
    return max(counts, key=lambda name: counts[name]) if counts else None


def iter_gguf_weights(path: Path, config: dict[str, Any]) -> Iterator[tuple[str, Tensor | CompactWeight]]:
    """(Hugging Face name, tensor) for every tensor of the GGUF file: float32 tensors for float types and
    1-D tensors, CompactWeight blocks for quantized matrices; q/k rows in Hugging Face's rotary order.
    rope_freqs.weight is not a weight (the config holds its factors) and is not yielded."""
    index = [entry for entry in read_index(path) if entry.name != ROPE_FREQS]
    for entry in index:  # every name and type is checked before any data is read
        hf_tensor_name(entry.name)
        _format(entry)
    with open(path, "rb") as file:
        for entry in index:
            fmt, name = _format(entry), hf_tensor_name(entry.name)
            cols, rows = entry.dims[0], int(np.prod(entry.dims[1:], dtype=np.int64))
            row_bytes = fmt.row_bytes(cols)
            raw = _read(file, entry, rows * row_bytes).reshape(rows, row_bytes)
            heads = rotary_heads(name, config)
            raw = unpermute_rotary_rows(raw, heads) if heads is not None else raw
            if fmt.name in FLOAT_TYPES or len(entry.dims) != 2:
                shape = tuple(reversed(entry.dims))
                yield name, fmt.dequantize(torch.from_numpy(raw)).reshape(shape)
            else:
                yield name, CompactWeight(fmt.name, torch.from_numpy(raw), cols)


def _read(file: BinaryIO, entry: TensorEntry, nbytes: int) -> np.ndarray:
    """The tensor's bytes, read into memory of their own. Read rather than memory-mapped: the pages of a
    mapped file count in the process's resident memory until it is unmapped, and a mapping held over
    the whole load added them to the peak (1B-shape Q4_K_M, one request: 1,706 against 1,623 MB)."""
    out = np.empty(nbytes, dtype=np.uint8)
    file.seek(entry.offset)
    if file.readinto(memoryview(out)) != nbytes:
        raise ValueError(f"gguf: tensor {entry.name} runs past the end of the file (truncated?)")
    return out
