"""The bf16-weight GEMV (`native/gemv_bf16w.c`): exact against fp32 `F.linear`, used only where the
bf16 copy is exact, chosen by rows, and giving the fp32 model's tokens."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from forerun import LLM, SamplingParams
from forerun.model.linear_kernels import split_by_rows
from forerun.model.native_build import load_native_library
from forerun.model.native_gemv import BF16WeightGemv
from forerun.worker import cpu_probe
from tests.conftest import save_tiny_model


@pytest.fixture(scope="module")
def gemv(tmp_path_factory) -> BF16WeightGemv:
    lib = load_native_library(tmp_path_factory.mktemp("kernels"))
    assert lib is not None, "gcc is on every machine of this project: the kernel must build"
    return BF16WeightGemv(lib)


def _bf16_exact(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


# Every row-group size (1-4 and a remainder past 4) and a column count that is not a multiple of 4.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_linear(gemv, rows, with_bias):
    w, x = _bf16_exact(67, 96), torch.randn(rows, 96)
    b = torch.randn(67) if with_bias else None
    fn = gemv.linear(w, b)
    assert fn is not None
    got, want = fn(x), F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_three_dimensional_and_strided_inputs(gemv):
    w = _bf16_exact(32, 64)
    x = torch.randn(2, 3, 128)[..., ::2]  # a strided view
    got = gemv.linear(w, None)(x)
    assert got.shape == (2, 3, 32)
    assert (got - F.linear(x, w)).abs().max().item() <= 1e-4


def test_refuses_weights_it_cannot_read_exactly(gemv):
    assert gemv.linear(torch.randn(16, 64), None) is None, "fp32 values not representable in bf16"
    assert gemv.linear(_bf16_exact(16, 60), None) is None, "in_features not a multiple of 8"
    assert gemv.linear(_bf16_exact(16, 64).bfloat16(), None) is None, "a bf16 model uses its own matmuls"


def test_split_by_rows_routes_small_inputs_only():
    small, large = (lambda x: torch.zeros(x.shape[0])), (lambda x: torch.ones(x.shape[0]))
    fn = split_by_rows(small, large, 4)
    assert fn(torch.empty(4, 8)).sum() == 0 and fn(torch.empty(5, 8)).sum() == 5


def test_rows_stop_at_the_first_loss():
    assert cpu_probe.gemv_rows_from({1: 1.4, 2: 1.2, 4: 1.01, 8: 0.9, 16: 1.1}) == 4
    assert cpu_probe.gemv_rows_from({1: 0.8, 2: 1.5}) == 0
    assert cpu_probe.gemv_rows_from({}) == 0


def test_probe_measures_then_reads_the_cache(gemv, tmp_path, monkeypatch):
    shapes, cache = [(64, 96, 2), (96, 64, 2)], tmp_path / "probe.json"
    rows, speedup = cpu_probe.choose_gemv_rows(shapes, "mkldnn", gemv, 8, cache)
    assert set(speedup) <= {1, 2, 4, 8} and 1 in speedup and all(v > 0 for v in speedup.values())
    assert rows == cpu_probe.gemv_rows_from(speedup)
    monkeypatch.setattr(cpu_probe, "measure_gemv", lambda *a, **k: pytest.fail("measured twice"))
    assert cpu_probe.choose_gemv_rows(shapes, "mkldnn", gemv, 8, cache) == (rows, speedup)


def test_engine_tokens_match_fp32_and_log_the_choice(tmp_path, smollm2_dir, caplog):
    folder = save_tiny_model(tmp_path / "bf16-tiny", smollm2_dir, stored_dtype="bfloat16")
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    prompts = [[7, 8, 9] * 5, [300, 301], list(range(500, 530))]
    outs = {}
    for rows in (0, 8):
        with caplog.at_level(logging.INFO, logger="forerun.worker.worker"):
            with LLM(model=str(folder), dtype="float32", gemv_max_rows=rows, show_progress=False) as llm:
                got = llm.generate(prompts, sp, use_tqdm=False)
        outs[rows] = [(o.outputs[0].token_ids, [sorted(lp) for lp in o.outputs[0].logprobs]) for o in got]
    assert outs[0] == outs[8]
    assert "matmuls of up to 8 rows read bf16 weights in fp32 arithmetic (9 of 9" in caplog.text
    with pytest.raises(ValueError, match="gemv_max_rows"):
        LLM(model=str(folder), gemv_max_rows=-1, show_progress=False)
