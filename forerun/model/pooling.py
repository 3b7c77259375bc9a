"""Turning per-token hidden states into one vector per sequence (embeddings)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

PoolingMethod = Literal["mean", "cls", "last"]
_METHODS: tuple[str, ...] = ("mean", "cls", "last")

# sentence-transformers pooling flags we can honour, and the method each selects.
_ST_FLAGS: dict[str, PoolingMethod] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
# Flags we recognise but do not implement: refusing is better than a silently different vector.
_ST_UNSUPPORTED: tuple[str, ...] = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolingConfig:
    """How to pool one sequence's hidden states into an embedding.

    Invariant: `method` is one of "mean", "cls", "last"; when `normalize` is set every
    pooled vector has unit L2 norm (a zero vector stays zero).
    """

    method: PoolingMethod
    normalize: bool

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"PoolingConfig.method must be one of {_METHODS}, got {self.method!r}")

    @classmethod
    def from_folder(cls, folder: Path, default: str = "last") -> PoolingConfig:
        """Read a sentence-transformers layout (modules.json, <pooling dir>/config.json).

        A folder without one (a decoder model used for embeddings) gets `default` pooling
        with normalisation, the usual convention for last-token embedding models.
        """
        if default not in _METHODS:
            raise ValueError(f"default must be one of {_METHODS}, got {default!r}")
        folder = Path(folder)
        modules = _read_modules(folder)
        pooling_dir = _pooling_dir(folder, modules)
        if pooling_dir is None:
            return cls(method=cast(PoolingMethod, default), normalize=True)
        method = _method_from_st_config(pooling_dir / "config.json")
        # Without modules.json we cannot know whether a Normalize module follows.
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        return cls(method=method, normalize=normalize)


def _read_modules(folder: Path) -> list[dict[str, Any]]:
    path = folder / "modules.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: modules.json must be a list of modules")
    return [m for m in data if isinstance(m, dict)]


def _pooling_dir(folder: Path, modules: list[dict[str, Any]]) -> Path | None:
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            candidate = folder / str(m.get("path", ""))
            if (candidate / "config.json").is_file():
                return candidate
    fallback = folder / "1_Pooling"
    return fallback if (fallback / "config.json").is_file() else None


def _method_from_st_config(path: Path) -> PoolingMethod:
    data = json.loads(path.read_text())
    for flag in _ST_UNSUPPORTED:
        if data.get(flag):
            raise ValueError(f"{path}: {flag} is not supported")
    chosen = [method for flag, method in _ST_FLAGS.items() if data.get(flag)]
    if len(chosen) != 1:
        raise ValueError(f"{path}: exactly one pooling_mode_* flag must be true, got {chosen}")
    return chosen[0]


def pool(hidden: Tensor, query_start_loc: list[int], cfg: PoolingConfig) -> Tensor:
    """Pool flattened hidden states [T, H] into [B, H] float32 embeddings.

    Sequence b owns rows query_start_loc[b]:query_start_loc[b + 1]; every sequence must be
    complete (the whole prompt) and non-empty. Accumulates in float32 so that half-precision
    models do not lose the mean to rounding.
    """
    lens = _check_starts(query_start_loc, hidden)
    starts = query_start_loc[:-1]
    device = hidden.device
    if cfg.method == "cls":
        out = hidden[torch.tensor(starts, device=device)].float()
    elif cfg.method == "last":
        ends = [e - 1 for e in query_start_loc[1:]]
        out = hidden[torch.tensor(ends, device=device)].float()
    else:
        seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, seg, hidden.float())
        out = sums / torch.tensor(lens, dtype=torch.float32, device=device).unsqueeze(1)
    return F.normalize(out, p=2.0, dim=-1) if cfg.normalize else out


def _check_starts(query_start_loc: list[int], hidden: Tensor) -> list[int]:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if len(query_start_loc) < 2 or query_start_loc[0] != 0:
        raise ValueError("query_start_loc must start at 0 and name at least one sequence")
    if query_start_loc[-1] != hidden.shape[0]:
        raise ValueError(
            f"query_start_loc ends at {query_start_loc[-1]} but hidden has {hidden.shape[0]} rows"
        )
    lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
    if min(lens) < 1:
        raise ValueError("query_start_loc must be strictly increasing (no empty sequences)")
    return lens
