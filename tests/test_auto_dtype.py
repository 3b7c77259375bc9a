"""FORERUN_AUTO_DTYPES pins what `dtype="auto"` may pick, so a fleet of mixed CPUs gives one answer."""

from __future__ import annotations

import pytest
import torch

from forerun import LLM
from forerun.worker.numerics import AUTO_DTYPES_ENV, auto_dtypes


def test_auto_measures_fp32_and_bf16_unless_pinned():
    assert auto_dtypes({}) == [torch.float32, torch.bfloat16]
    assert auto_dtypes({AUTO_DTYPES_ENV: " bfloat16 "}) == [torch.bfloat16]
    assert auto_dtypes({AUTO_DTYPES_ENV: "float32,bfloat16"}) == [torch.float32, torch.bfloat16]
    with pytest.raises(ValueError, match="FORERUN_AUTO_DTYPES: unknown dtype 'fp8'"):
        auto_dtypes({AUTO_DTYPES_ENV: "float32,fp8"})


@pytest.mark.parametrize("pinned", ["float32", "bfloat16"])
def test_a_pinned_auto_dtype_is_what_the_engine_runs(tiny_llama_dir, monkeypatch, pinned):
    monkeypatch.setenv(AUTO_DTYPES_ENV, pinned)
    with LLM(model=str(tiny_llama_dir), dtype="auto", show_progress=False) as llm:
        worker = llm.engine.core.executor.worker
        assert worker.kernel_choice.dtype == pinned
        assert worker.dtype == getattr(torch, pinned)
