"""The CPU probe never draws from torch's global RNG: every rank and every start samples one stream.

Sampling without a per-request seed draws from the global RNG on every tensor-parallel rank, and each
rank feeds its own sampled token to the next step. The probe runs on rank 0 only, and only when its
answer is not cached yet; had it drawn its random matrices from the global RNG, rank 0 would sample
other tokens than rank 1 on a first start (activations of two sequences mixed) and a single rank other
tokens on a first start than on later ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forerun import LLM, SamplingParams
from forerun.loader.model_source import cache_dir
from forerun.kernels.build import load_native_library
from forerun.kernels.gemm import PackedGemm
from forerun.kernels.gemv import CompactGemv
from forerun.kernels import probe
from tests.conftest import judge_machine
from tests.conftest import cache_sharing_kernels

SHAPES = [(64, 96, 2), (96, 64, 2), (64, 500, 1)]
PROMPTS = [[5, 6, 7, 8, 9] * 3, [100, 200, 300], list(range(10, 40))]
SEED = 1234


@pytest.fixture(scope="module")
def lib():
    built = load_native_library(cache_dir() / "kernels")  # where the engine builds it: usually built already
    assert built is not None, "gcc is on every machine of this project: the kernels must build"
    return built


def test_probe_measurements_leave_the_global_rng_alone(lib, tmp_path, monkeypatch):
    judge_machine(monkeypatch, False)
    gemm = PackedGemm(lib)
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    choice = probe.choose_kernels(SHAPES, 8, [torch.float32, torch.bfloat16], None, tmp_path / "p.json", gemm)
    assert choice.gflops, "several candidates: the probe really measured"
    probe.measure(SHAPES, 8, [(torch.float32, "native")], gemm=gemm)
    pair = probe.dense_pair("aten", CompactGemv(lib), torch.float32)
    rows, speedup = probe.choose_gemv_rows(SHAPES[:2], pair, "bf16", 4, tmp_path / "p.json", ["aten"])
    assert speedup, "the GEMV probe really measured"
    assert torch.equal(torch.get_rng_state(), before), "the probe drew from torch's global RNG"


@pytest.fixture
def cold_cache(tmp_path, monkeypatch) -> Path:
    """An empty forerun cache (FORERUN_CACHE, inherited by worker processes) whose kernels folder is
    the user's, so the C kernels are not rebuilt; returns where the probe's cache file will be."""
    root = cache_sharing_kernels(tmp_path / "forerun-cache")
    monkeypatch.setenv("FORERUN_CACHE", str(root))
    return root / "cpu_probe.json"


def _sample(model: Path, backend: str, tp: int) -> list[list[int]]:
    # dtype fixed to fp32 (the same on every CPU), linear kernel "auto": several candidates to measure.
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(model), dtype="float32", linear_kernel="auto", seed=SEED, tensor_parallel_size=tp,
             distributed_executor_backend=backend, show_progress=False) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.parametrize("backend,tp", [("uni", 1), ("mp", 2)])
def test_a_cold_probe_cache_samples_what_a_warm_one_does(tiny_llama_dir, cold_cache, backend, tp):
    assert not cold_cache.exists()
    cold = _sample(tiny_llama_dir, backend, tp)
    assert cold_cache.is_file(), "the first start must have measured (and cached) the matmul probe"
    entries = json.loads(cold_cache.read_text())
    assert any(entry.get("gflops") for entry in entries.values()), "the probe timed several candidates"
    warm = _sample(tiny_llama_dir, backend, tp)
    assert cold == warm, "the same engine seed must sample the same tokens on a first and a later start"
    assert len({tuple(t) for t in cold}) == len(PROMPTS), "sampled outputs are varied, so equality means something"
