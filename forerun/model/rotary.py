"""Rotary position embedding: the table of cos and sin factors, with the rope scalings models are
trained or extended with (linear, llama3, YaRN, and the per-frequency divisors of GGUF files)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED = ("default", "linear", "llama3", "yarn", "freq_factors")


def _factor(scaling: dict[str, Any]) -> float:
    factor = float(scaling.get("factor", float("nan")))
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"rope_scaling: factor must be a positive number, got {scaling.get('factor')!r}")
    return factor


def _llama3(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    factor = _factor(scaling)
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept; the band between blends linearly.
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times longer (1 when not longer)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: Tensor, head_dim: int, base: float, scaling: dict[str, Any]) -> tuple[Tensor, float]:
    """YaRN ("NTK by parts"): a frequency that turns more than `beta_fast` times over the original
    context keeps its speed, one that turns fewer than `beta_slow` times turns `factor` times slower,
    and the frequencies between blend linearly in their index. cos and sin are scaled by the attention
    factor, which multiplies every attention logit by its square."""
    factor = _factor(scaling)
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling: yarn needs original_max_position_embeddings (the context it extends)")
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32.0), float(scaling.get("beta_slow") or 1.0)

    def index(turns: float) -> float:  # the frequency index that turns `turns` times over the original context
        return head_dim * math.log(float(original) / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = index(beta_fast), index(beta_slow)
    if scaling.get("truncate", True):  # whole indices, as transformers and llama.cpp take them by default
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = high - low if high != low else 0.001
    slowed = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / span).clamp(0.0, 1.0)
    inv = inv_freq / factor * slowed + inv_freq * (1 - slowed)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim
                     else _yarn_mscale(factor))
    return inv, float(attention)


def rope_frequencies(head_dim: int, base: float, scaling: dict[str, Any] | None) -> tuple[Tensor, float]:
    """The inverse frequencies [head_dim / 2] of a config's rope settings, and the factor its cos and
    sin are multiplied by (1 but for YaRN)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / _factor(scaling), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, base, scaling)
    if kind == "freq_factors":  # a GGUF file's rope_freqs.weight (forerun.loader.gguf_rope)
        factors = torch.tensor([float(f) for f in scaling["factors"]], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_scaling: {factors.numel()} frequency factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors, 1.0
    raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (supported: {', '.join(SUPPORTED)})")


# Rows of the table built with the model: what runs before the engine settles max_model_len (weight
# loading, matmul warm-up) never reaches past them, and a file's whole context (1,024,000 positions for
# Mistral NeMo: a gigabyte of table at head_dim 128) is never built at once.
_FIRST_ROWS = 8192


class RotaryEmbedding(nn.Module):
    """Rotate-half ("neox") rotary embedding with a precomputed cos/sin table.

    Invariant: `table[p] = cat(cos, cos, -sin, sin)` of position p's angles (times the scaling's
    attention factor), so one index_select per step yields both factors for every layer. The table
    holds the first min(max_position, 8192) positions until `resize` sets its length.
    """

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim: rotary needs an even head_dim, got {head_dim}")
        self.head_dim, self.max_position = head_dim, max_position
        self._inv_freq, self._attention = rope_frequencies(head_dim, base, scaling)
        self.register_buffer("table", self._rows(0, min(max_position, _FIRST_ROWS)), persistent=False)

    def _rows(self, start: int, stop: int) -> Tensor:
        """The table's rows for positions start .. stop - 1 (fp32)."""
        angles = torch.outer(torch.arange(start, stop, dtype=torch.int64).float(), self._inv_freq)
        cos, sin = angles.cos(), angles.sin()
        if self._attention != 1.0:
            cos, sin = cos * self._attention, sin * self._attention
        return torch.cat((cos, cos, -sin, sin), dim=-1)

    def resize(self, rows: int) -> bool:
        """Hold the first min(rows, max_position) positions (in the table's dtype and device); whether
        the table changed."""
        rows = min(rows, self.max_position)
        if rows == self.table.shape[0]:
            return False
        if rows < self.table.shape[0]:
            self.table = self.table[:rows].clone()
        else:  # the rows held are kept; only the new ones are computed
            more = self._rows(self.table.shape[0], rows).to(dtype=self.table.dtype, device=self.table.device)
            self.table = torch.cat((self.table, more))
        return True

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token factors [T, 1, head_dim] each, broadcastable over heads."""
        both = self.table.index_select(0, positions).unsqueeze(1)
        return both[..., : self.head_dim], both[..., self.head_dim :]

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate x [T, heads, head_dim]; `sin` carries the sign of rotate-half's first half."""
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)
