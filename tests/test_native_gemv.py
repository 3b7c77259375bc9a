"""The compact-weight GEMV (`csrc/gemv_compact.c`): its bf16 and GGUF-block forms expand exactly to
the fp32 weights, the kernel matches fp32 `F.linear`, and engines give the fp32 model's tokens."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from forerun import LLM, SamplingParams
from forerun.kernels.compact_weights import CompactWeight
from forerun.loader.gguf_convert import describe_gguf, export_hf_folder
from forerun.kernels.linear import split_by_rows
from forerun.kernels.build import load_native_library
from forerun.kernels.gemv import CompactGemv
from forerun.kernels import probe
from tests.conftest import judge_machine
from forerun.loader.model_source import cache_dir
from tests.conftest import save_tiny_model
from tests.gguf_factory import write_model_gguf
from tests.test_gguf_convert import _tiny_model

GGUF_FORMATS = ["Q8_0", "Q4_0", "Q4_1"]


@pytest.fixture(scope="module")
def gemv() -> CompactGemv:
    lib = load_native_library(cache_dir() / "kernels")  # one build, shared with the engine's
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return CompactGemv(lib)


def _bf16_exact(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


def _gguf_weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[CompactWeight, np.ndarray]:
    """Blocks quantized by the gguf package, and the package's own de-quantization of them."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[fmt]
    blocks = gguf.quants.quantize(values, qtype)
    return CompactWeight(fmt, torch.from_numpy(blocks), k), gguf.quants.dequantize(blocks, qtype)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_gguf_blocks_expand_exactly_as_the_reference(fmt):
    weight, reference = _gguf_weight(fmt, 7, 96)
    assert torch.equal(weight.expand(), torch.from_numpy(reference))


# Row counts: every group size of 1-4 and a remainder past 4; 67 output columns (an odd split).
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("fmt", ["bf16", *GGUF_FORMATS])
def test_kernel_matches_fp32_linear(gemv, rows, fmt):
    if fmt == "bf16":
        weight = CompactWeight.bf16_of(_bf16_exact(67, 104))  # 104: a bf16 row tail past the blocks of 32
    else:
        weight = _gguf_weight(fmt, 67, 96)[0]
    dense, x, b = weight.expand(), torch.randn(rows, weight.k), torch.randn(67)
    for bias in (None, b):
        got, want = gemv.linear(weight, bias)(x), F.linear(x, dense, bias)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_three_dimensional_and_strided_inputs(gemv):
    weight = CompactWeight.bf16_of(_bf16_exact(32, 64))
    x = torch.randn(2, 3, 128)[..., ::2]  # a strided view
    got = gemv.linear(weight, None)(x)
    assert got.shape == (2, 3, 32)
    assert (got - F.linear(x, weight.expand())).abs().max().item() <= 1e-4


def test_forms_it_refuses(gemv):
    assert CompactWeight.bf16_of(torch.randn(16, 64)) is None, "fp32 values bf16 cannot hold"
    half = _bf16_exact(16, 64).bfloat16()
    form = CompactWeight.bf16_of(half)  # a bf16 model's weight is its own bf16 form
    assert form is not None and torch.equal(form.expand(), half.float())
    assert gemv.linear(CompactWeight.bf16_of(_bf16_exact(16, 60)), None) is None, "k not a multiple of 8"
    assert gemv.linear(None, None) is None
    q8, q4 = _gguf_weight("Q8_0", 4, 64)[0], _gguf_weight("Q4_1", 4, 64)[0]
    assert CompactWeight.cat([q8, q4]) is None, "packed parts must share one form"
    assert CompactWeight.cat([q8, q8]).data.shape == (8, q8.data.shape[1])


def test_split_by_rows_routes_small_inputs_only():
    small, large = (lambda x: torch.zeros(x.shape[0])), (lambda x: torch.ones(x.shape[0]))
    fn = split_by_rows(small, large, 4)
    assert fn(torch.empty(4, 8)).sum() == 0 and fn(torch.empty(5, 8)).sum() == 5


def test_rows_stop_at_the_first_loss():
    assert probe.gemv_rows_from({1: 1.4, 2: 1.2, 4: 1.01, 8: 0.9, 16: 1.1}) == 4
    assert probe.gemv_rows_from({1: 0.8, 2: 1.5}) == 0
    assert probe.gemv_rows_from({}) == 0


@pytest.mark.parametrize("fmt", ["bf16", "Q4_1"])
def test_probe_measures_then_reads_the_cache(gemv, tmp_path, monkeypatch, fmt):
    judge_machine(monkeypatch, False)  # the real load must not force a re-measure
    shapes, cache = [(64, 96, 2), (96, 64, 2)], tmp_path / "probe.json"
    pair = probe.dense_pair("mkldnn", gemv, torch.float32)
    rows, speedup = probe.choose_gemv_rows(shapes, pair, fmt, 8, cache, ["mkldnn"])
    assert set(speedup) <= {1, 2, 4, 8} and 1 in speedup and all(v > 0 for v in speedup.values())
    assert rows == probe.gemv_rows_from(speedup)
    monkeypatch.setattr(probe, "measure_gemv", lambda *a, **k: pytest.fail("measured twice"))
    assert probe.choose_gemv_rows(shapes, pair, fmt, 8, cache, ["mkldnn"]) == (rows, speedup)


@pytest.mark.parametrize("damage", [{"speedup": {"one": 1.2}}, {"speedup": {"1": "fast"}}, {"speedup": [1.2]},
                                    {"speedup": {"1": 1.2}, "extra": 1}, {}])
def test_a_damaged_gemv_entry_is_measured_again(gemv, tmp_path, monkeypatch, damage):
    judge_machine(monkeypatch, False)
    shapes, cache = [(64, 96, 2), (96, 64, 2)], tmp_path / "probe.json"
    pair = probe.dense_pair("aten", gemv, torch.float32)
    probe.choose_gemv_rows(shapes, pair, "bf16", 2, cache, ["aten"])
    (key,) = json.loads(cache.read_text())
    cache.write_text(json.dumps({key: damage}))
    calls = []
    monkeypatch.setattr(probe, "measure_gemv", lambda *a, **k: calls.append(1) or {1: 1.5, 2: 0.5})
    assert probe.choose_gemv_rows(shapes, pair, "bf16", 2, cache, ["aten"]) == (1, {1: 1.5, 2: 0.5})
    assert calls == [1]


# Both paths compute in fp32 and differ only in summation order: a few ulps of each dot product.
# Measured here: at most 1e-5 on logprobs of magnitude up to ~10; the bound leaves 10x for other CPUs.
LOGPROB_TOL = 1e-4


def _tokens_with_and_without(folder: Path, caplog, reference: Path | None = None) -> dict[int, list]:
    """Per row count (0: every matmul on fp32 weights, here those of `reference` when given; 8: the
    compact GEMV up to 8 rows), each prompt's tokens and, per position, its top logprobs as {token: logprob}."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[7, 8, 9] * 5, [30, 31], list(range(50, 80))]
    outs = {}
    for rows in (0, 8):
        model = reference if rows == 0 and reference is not None else folder
        with caplog.at_level(logging.INFO):
            with LLM(model=str(model), dtype="float32", gemv_max_rows=rows, show_progress=False) as llm:
                got = llm.generate(prompts, sp, use_tqdm=False)
        outs[rows] = [(list(o.outputs[0].token_ids), [dict(lp) for lp in o.outputs[0].logprobs]) for o in got]
    return outs


def _assert_same_outputs(outs: dict[int, list]) -> None:
    """Same tokens, same top-logprob tokens, and logprob values within LOGPROB_TOL."""
    assert len(outs[0]) == len(outs[8])
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(outs[0], outs[8]):
        assert tokens_a == tokens_b
        assert len(lps_a) == len(lps_b) == len(tokens_a)
        for a, b in zip(lps_a, lps_b):
            assert a.keys() == b.keys()
            worst = max(abs(a[t] - b[t]) for t in a)
            assert worst <= LOGPROB_TOL, f"logprobs differ by {worst:.2e} (tolerance {LOGPROB_TOL:.0e})"


def test_bf16_checkpoint_tokens_match_fp32(tmp_path, smollm2_dir, caplog):
    folder = save_tiny_model(tmp_path / "bf16-tiny", smollm2_dir, stored_dtype="bfloat16")
    outs = _tokens_with_and_without(folder, caplog)
    _assert_same_outputs(outs)
    assert "matmuls of up to 8 rows read compact weights in fp32 arithmetic (9 of 9" in caplog.text
    with pytest.raises(ValueError, match="gemv_max_rows"):
        LLM(model=str(folder), gemv_max_rows=-1, show_progress=False)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q5_1"])
def test_gguf_model_reads_its_own_blocks_and_matches_fp32(tmp_path, caplog, fmt):
    write_model_gguf(tmp_path / "m.gguf", _tiny_model("llama", True), "llama", gguf.GGMLQuantizationType[fmt])
    describe_gguf(tmp_path / "m.gguf", tmp_path / "model")  # what --model m.gguf makes in the cache
    export_hf_folder(tmp_path / "m.gguf", tmp_path / "hf")  # the same weights, de-quantized to fp32
    outs = _tokens_with_and_without(tmp_path / "model", caplog, reference=tmp_path / "hf")
    _assert_same_outputs(outs)
    assert f"the GGUF file's quantized matrices are held as stored ({fmt} mostly)" in caplog.text
    assert "(9 of 9 matmuls have an exact compact form)" in caplog.text
