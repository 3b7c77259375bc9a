"""GGML storage formats: one table entry per type (block size, bytes per block, decoder) and the
row de-quantization every later kernel is checked against.

Families: floats.py (F32, F16, BF16), legacy.py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), kquants.py
(Q2_K .. Q6_K), iq4.py (IQ4_NL, IQ4_XS). Types are named as in GGUF (`GGMLQuantizationType.name`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from torch import Tensor

from forerun.kernels.formats.common import QuantFormat
from forerun.kernels.formats.floats import FLOAT_FORMATS
from forerun.kernels.formats.iq4 import IQ4_FORMATS
from forerun.kernels.formats.kquants import K_FORMATS
from forerun.kernels.formats.legacy import LEGACY_FORMATS

QUANT_FORMATS: Mapping[str, QuantFormat] = MappingProxyType(
    {f.name: f for f in (*FLOAT_FORMATS, *LEGACY_FORMATS, *K_FORMATS, *IQ4_FORMATS)})


def quant_format(name: str) -> QuantFormat:
    """The table entry of type `name` (e.g. "Q4_K"); ValueError naming it when there is none."""
    fmt = QUANT_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"quant type: {name!r} is not supported; supported: {', '.join(QUANT_FORMATS)}")
    return fmt


def dequantize_rows(name: str, data: Tensor) -> Tensor:
    """uint8 [rows, row_bytes] of type `name` -> float32 [rows, cols], bit-identical to ggml."""
    return quant_format(name).dequantize(data)


__all__ = ["QUANT_FORMATS", "QuantFormat", "dequantize_rows", "quant_format"]
