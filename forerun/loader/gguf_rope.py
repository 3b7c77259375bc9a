"""The rotary settings of a GGUF file, read as llama.cpp reads them, as a Hugging Face `rope_scaling`.

llama.cpp's loader takes the scaling type to be linear where the file names none, and the factor from
`rope.scaling.factor` or the older `rope.scale_linear` (absent or 0: no scaling). Its converter writes
linear scaling (e.g. DeepSeek-Coder) and YaRN (the long-context Qwen2.5 and Qwen3 variants) this way;
Llama 3.1-style scaling comes as the tensor rope_freqs.weight instead (forerun.loader.gguf_tensors).
What forerun's rotary embedding does not compute is refused naming the field, so that no such file
runs as if it were unscaled.
"""

from __future__ import annotations

import math
from typing import Any

from forerun.loader.gguf_tensors import ROPE_FREQS


def _number(meta: dict[str, Any], key: str, default: float) -> float:
    try:
        value = float(meta.get(key, default))
    except (TypeError, ValueError):  # a string or an array where llama.cpp reads a float
        raise ValueError(f"gguf: {key} is {meta.get(key)!r}; expected a number") from None
    if not math.isfinite(value):
        raise ValueError(f"gguf: {key} is {value}; expected a finite number")
    return value


def _yarn(meta: dict[str, Any], key: str, factor: float, context_length: int) -> dict[str, Any]:
    # llama.cpp's YaRN temperature is transformers' (0.1 ln factor + 1), divided as transformers' mscale
    # and mscale_all_dim divide it where the file gives a log multiplier, times the file's attn_factor.
    original = int(meta.get(f"{key}.original_context_length") or context_length)
    out: dict[str, Any] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    for field, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{key}.{field}" in meta:
            beta = _number(meta, f"{key}.{field}", 0.0)
            if beta <= 0:
                raise ValueError(f"gguf: {key}.{field} is {beta}; expected a positive number")
            out[name] = beta
    log_mul = _number(meta, f"{key}.yarn_log_multiplier", 0.0)
    attn = _number(meta, f"{key}.attn_factor", 1.0)
    if log_mul != 0.0 or attn != 1.0:
        temperature = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        if log_mul != 0.0 and factor > 1:
            temperature /= 0.1 * log_mul * math.log(factor) + 1.0
        out["attention_factor"] = temperature * attn
    return out


def rope_scaling(meta: dict[str, Any], arch: str, head_dim: int, context_length: int,
                 freq_factors: list[float] | None) -> dict[str, Any] | None:
    """The Hugging Face `rope_scaling` of a GGUF file's metadata and rope_freqs.weight (`freq_factors`,
    kept as forerun's `freq_factors` rope type), or None for plain rotary; ValueError naming the field
    for what forerun does not compute."""
    key = f"{arch}.rope.scaling"
    kind = str(meta.get(f"{key}.type", "linear"))
    factor_key = f"{key}.factor" if f"{key}.factor" in meta else f"{arch}.rope.scale_linear"
    factor = _number(meta, factor_key, 0.0) or 1.0
    if factor < 0:
        raise ValueError(f"gguf: {factor_key} is {factor}; expected a positive number")
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"gguf: {key}.type {kind!r} is not supported; supported: none, linear, yarn")
    ext = _number(meta, f"{key}.yarn_ext_factor", -1.0)  # negative: not set
    if ext >= 0 and ext != (1.0 if kind == "yarn" else 0.0):
        raise ValueError(f"gguf: {key}.yarn_ext_factor is {ext}; forerun runs YaRN at 1 and other types at 0")
    if kind != "yarn":
        for field in ("attn_factor", "yarn_attn_factor"):  # cos and sin scaled: transformers' linear has no such factor
            if _number(meta, f"{key}.{field}", 1.0) != 1.0:
                raise ValueError(f"gguf: {key}.{field} is {meta[f'{key}.{field}']}; forerun supports it with "
                                 "yarn scaling only")
    scaled = kind == "yarn" or (kind == "linear" and factor != 1.0)
    if freq_factors is not None:
        if scaled:
            raise ValueError(f"gguf: tensor {ROPE_FREQS} together with {key}.type {kind!r} (factor {factor}) is "
                             "not supported")
        if len(freq_factors) != head_dim // 2:
            raise ValueError(f"gguf: tensor {ROPE_FREQS} holds {len(freq_factors)} factors; heads of {head_dim} "
                             f"dimensions turn at {head_dim // 2} frequencies")
        return {"rope_type": "freq_factors", "factors": freq_factors}
    if kind == "yarn":
        return _yarn(meta, key, factor, context_length)
    return {"rope_type": "linear", "factor": factor} if scaled else None
