"""GGUF tensors to Hugging Face tensors: de-quantization, renaming and the q/k row order."""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor

from forerun.kernels.formats import QUANT_FORMATS

# Every type forerun's own de-quantizers read (forerun.kernels.formats, checked bit for bit against
# the gguf package's reference in tests/test_quant_formats.py).
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    t for t in GGMLQuantizationType if t.name in QUANT_FORMATS)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# Not a weight: llama.cpp's converter writes Llama 3.1-style rope scaling as one divisor per rotary
# frequency (each pair of head dimensions turns at base^(-2i / head_dim) / factor_i radians a position).
ROPE_FREQS = "rope_freqs.weight"


def supported_type_names() -> str:
    """Comma-separated names of the supported tensor types, for error messages."""
    return ", ".join(sorted(t.name for t in SUPPORTED_TYPES))


def check_tensor_type(tensor: ReaderTensor) -> None:
    """Raise ValueError naming the tensor when its storage type cannot be de-quantized here."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"gguf: unsupported quant type {tensor.tensor_type.name} in tensor {tensor.name}; "
            f"supported: {supported_type_names()}")


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in torch's (row-major, outermost first) shape order.

    GGUF lists dimensions innermost first, and each row (innermost dimension) is stored as whole
    blocks, so the bytes are read as [rows, bytes per row] and de-quantized row by row.
    """
    check_tensor_type(tensor)
    fmt = QUANT_FORMATS[tensor.tensor_type.name]
    torch_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    cols = torch_shape[-1] if torch_shape else 1
    if cols % fmt.block_size != 0:
        raise ValueError(f"gguf: tensor {tensor.name} has rows of {cols} values, "
                         f"not a multiple of {fmt.name}'s block of {fmt.block_size}")
    raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, fmt.row_bytes(cols))
    # A copy: the reader's memory map is read-only, which torch.from_numpy does not accept quietly.
    values = fmt.dequantize(torch.from_numpy(np.array(raw, copy=True)))
    return values.numpy().reshape(torch_shape)


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama-family name of a GGUF tensor; ValueError for anything unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    if gguf_name == ROPE_FREQS:
        raise ValueError(f"gguf: tensor {ROPE_FREQS} holds rotary frequency factors, not a weight")
    raise ValueError(f"gguf: tensor {gguf_name} has no Llama-family equivalent")


def rope_freq_factors(tensor: ReaderTensor) -> list[float]:
    """The divisors `rope_freqs.weight` holds, one per rotary frequency; ValueError naming the tensor
    unless each is a positive finite number (a zero or negative one would stop or reverse a rotation)."""
    check_tensor_type(tensor)
    values = dequantize_tensor(tensor).reshape(-1)
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"gguf: tensor {ROPE_FREQS} must hold positive finite factors")
    return [float(v) for v in values]


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows.

    Hugging Face rotary embeddings pair dimension j with j + head_dim/2 inside each head
    ("rotate half"); llama.cpp pairs neighbours (2j, 2j+1), so its converter interleaves the two
    halves of every head. Row j*2 + s of a GGUF head is row s*head_dim/2 + j of the HF head.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads) != 0:
        raise ValueError(f"gguf: {rows} q/k rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    grouped = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weight.shape))
