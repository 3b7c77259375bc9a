"""forerun.kernels.formats: every GGML format's table entry and de-quantization, checked bit for bit
against the gguf package's reference (`gguf.quants.dequantize`) on random blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import FP16_FIELDS, random_blocks

from forerun.kernels.formats import QUANT_FORMATS, dequantize_rows, quant_format

ALL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def _bits(values: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns, so -0.0 != 0.0 and the comparison is exact."""
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def test_table_names_the_requested_types_with_ggml_sizes() -> None:
    assert sorted(QUANT_FORMATS) == sorted(ALL_TYPES)
    for name, fmt in QUANT_FORMATS.items():
        assert fmt.name == name
        assert fmt.ggml_type == int(Q[name]), name
        assert (fmt.block_size, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[Q[name]], name


@pytest.mark.parametrize("name", ALL_TYPES)
@pytest.mark.parametrize(("rows", "blocks_per_row"), [(1, 1), (7, 3)])
def test_dequantize_is_bit_identical_to_gguf(name: str, rows: int, blocks_per_row: int) -> None:
    fmt = quant_format(name)
    rng = np.random.default_rng([int(Q[name]), rows, blocks_per_row])
    cols = fmt.block_size * blocks_per_row
    if fmt.block_size == 1:
        cols *= 64  # float types: rows of 64 and 192 elements
    raw = random_blocks(Q[name], rows, cols, rng)  # random codes, any finite fp16 scale bits
    assert raw.shape == (rows, fmt.row_bytes(cols)) and raw.dtype == np.uint8
    want = gguf.quants.dequantize(raw, Q[name]).reshape(rows, cols)
    assert np.isfinite(want).all()  # finite scales: the comparison below is about values, not NaNs
    got = dequantize_rows(name, torch.from_numpy(raw.copy()))
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, cols)
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(_bits(got.numpy()), _bits(want))


@pytest.mark.parametrize("name", sorted(FP16_FIELDS, key=int), ids=lambda t: t.name)
def test_every_byte_of_a_block_matters(name: Q) -> None:
    """Changing any one byte of a block changes its values: no field is read from the wrong place
    or ignored (guards the layouts beyond what random data happens to exercise)."""
    fmt = quant_format(name.name)
    rng = np.random.default_rng(int(name))
    block = random_blocks(name, 1, fmt.block_size, rng, std=1.0)
    base = dequantize_rows(fmt.name, torch.from_numpy(block.copy()))
    for at in range(fmt.block_bytes):
        changed = block.copy()
        changed[0, at] ^= 0x24 if at not in FP16_FIELDS[name] else 0x01  # flip bits in every nibble pair
        got = dequantize_rows(fmt.name, torch.from_numpy(changed))
        want = gguf.quants.dequantize(changed, name).reshape(1, -1)
        assert np.array_equal(_bits(got.numpy()), _bits(want)), (name.name, at)
        assert not torch.equal(got, base), (name.name, at)


def test_large_tensor_is_decoded_in_chunks_identically() -> None:
    fmt = quant_format("Q4_K")
    rng = np.random.default_rng(5)
    raw = random_blocks(Q.Q4_K, 1100, 4096, rng, std=0.02)  # more than one chunk of rows
    got = fmt.dequantize(torch.from_numpy(raw))
    assert np.array_equal(_bits(got.numpy()), _bits(gguf.quants.dequantize(raw, Q.Q4_K)))


def test_unknown_type_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"quant type: 'Q7_K' is not supported; supported: .*Q4_K.*IQ4_XS"):
        quant_format("Q7_K")
    with pytest.raises(ValueError, match="quant type: 'IQ2_XXS'"):
        dequantize_rows("IQ2_XXS", torch.zeros(1, 66, dtype=torch.uint8))


def test_bad_shapes_and_dtypes_name_the_field() -> None:
    fmt = quant_format("Q6_K")
    assert fmt.row_bytes(512) == 420 and fmt.cols(420) == 512
    with pytest.raises(ValueError, match="cols: 576 is not a positive multiple of Q6_K's block size 256"):
        fmt.row_bytes(576)
    with pytest.raises(ValueError, match="row_bytes: 200 is not a positive multiple of Q6_K's block bytes 210"):
        fmt.dequantize(torch.zeros(2, 200, dtype=torch.uint8))
    with pytest.raises(ValueError, match="data: expected a 2-D uint8 tensor"):
        fmt.dequantize(torch.zeros(2, 210, dtype=torch.int8))
    with pytest.raises(ValueError, match="data: expected a 2-D uint8 tensor"):
        fmt.dequantize(torch.zeros(210, dtype=torch.uint8))
