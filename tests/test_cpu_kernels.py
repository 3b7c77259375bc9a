"""Prepacked matmul kernels and the per-machine dtype/kernel probe."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from forerun import LLM, SamplingParams
from forerun.kernels.linear import available_kernels, make_linear
from forerun.kernels import probe
from tests.conftest import judge_machine
from forerun.kernels.probe import choose_kernels

CPU = torch.device("cpu")
SHAPES = [(64, 96, 2), (96, 64, 2), (64, 500, 1)]


def test_fp32_has_a_packed_kernel_on_every_cpu_build():
    assert available_kernels(torch.float32, CPU) == ["aten", "mkldnn"]
    assert available_kernels(torch.float32, torch.device("meta")) == ["aten"]


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    want = F.linear(x, w, b)
    got = make_linear(w, b, "mkldnn", batch_hint=64)(x)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-4
    with pytest.raises(ValueError, match="linear_kernel"):
        make_linear(w, b, "cublas", 64)


@pytest.mark.parametrize("kernel", ["mkldnn", "native"])
def test_packed_model_gives_the_same_tokens(tiny_llama_dir, kernel):
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[5, 6, 7, 8, 9] * 3, [100, 200, 300], list(range(10, 80))]
    results = {}
    for name in ("aten", kernel):
        # gemv off: every matmul, one row or many, runs on the kernel under test.
        with LLM(model=str(tiny_llama_dir), dtype="float32", linear_kernel=name, gemv_max_rows=0,
                 show_progress=False) as llm:
            results[name] = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(results["aten"], results[kernel]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, v in la.items():
                assert abs(lb[tok] - v) <= 1e-3 * max(1.0, abs(v))


def test_probe_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    judge_machine(monkeypatch, False)  # the real load must not force a re-measure
    cache = tmp_path / "probe.json"
    first = choose_kernels(SHAPES, 8, [torch.float32, torch.bfloat16], None, cache)
    assert set(first.gflops) >= {"float32/aten", "float32/mkldnn", "bfloat16/aten"}
    assert all(g > 0 for g in first.gflops.values())
    assert f"{first.dtype}/{first.linear_kernel}" == max(first.gflops, key=first.gflops.get)
    assert len(json.loads(cache.read_text())) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again despite a cached answer")

    monkeypatch.setattr(probe, "measure", no_measuring)
    assert choose_kernels(SHAPES, 8, [torch.float32, torch.bfloat16], None, cache) == first
    # A fixed dtype and kernel leave a single candidate: nothing to measure, nothing cached.
    fixed = choose_kernels(SHAPES, 8, [torch.float32], ["aten"], cache)
    assert (fixed.dtype, fixed.linear_kernel, fixed.gflops) == ("float32", "aten", {})
    with pytest.raises(ValueError, match="linear_kernel"):
        choose_kernels(SHAPES, 8, [torch.float32], ["nonexistent"], cache)


def test_a_choice_timed_on_a_busy_machine_is_timed_again_when_calm(tmp_path, monkeypatch):
    cache, calls = tmp_path / "probe.json", []
    real = probe.measure
    monkeypatch.setattr(probe, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    judge_machine(monkeypatch, True)
    choose_kernels(SHAPES, 8, [torch.float32, torch.bfloat16], None, cache)
    choose_kernels(SHAPES, 8, [torch.float32, torch.bfloat16], None, cache)
    assert len(calls) == 1, "still busy: the busy measurement is kept rather than repeated"
    judge_machine(monkeypatch, False)
    choose_kernels(SHAPES, 8, [torch.float32, torch.bfloat16], None, cache)
    choose_kernels(SHAPES, 8, [torch.float32, torch.bfloat16], None, cache)
    assert len(calls) == 2, "calm now: measured once more, and that answer is final"
    assert list(json.loads(cache.read_text()).values())[0][probe.BUSY] is False


DAMAGES = {
    "missing field": lambda e: {k: v for k, v in e.items() if k != "linear_kernel"},
    "extra field": lambda e: {**e, "threads": 4},
    "unknown dtype": lambda e: {**e, "dtype": "float8"},
    "unknown kernel": lambda e: {**e, "linear_kernel": "cublas"},
    "wrong type of dtype": lambda e: {**e, "dtype": 32},
    "wrong type of gflops": lambda e: {**e, "gflops": "fast"},
    "wrong type in gflops": lambda e: {**e, "gflops": {"float32/aten": "12"}},
    "not an object": lambda e: ["float32", "aten"],
}


@pytest.mark.parametrize("damage", ["unparsable", *DAMAGES])
def test_damaged_cache_is_measured_again(tmp_path, monkeypatch, damage):
    judge_machine(monkeypatch, False)  # only the damage may force a measurement
    cache = tmp_path / "probe.json"
    first = choose_kernels(SHAPES, 4, [torch.float32], None, cache)
    if damage == "unparsable":
        cache.write_text("{not json")
    else:
        (key, entry), = json.loads(cache.read_text()).items()
        cache.write_text(json.dumps({key: DAMAGES[damage](entry)}))
    calls = []
    real = probe.measure
    monkeypatch.setattr(probe, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    choice = choose_kernels(SHAPES, 4, [torch.float32], None, cache)
    assert calls == [1], "a damaged entry is measured again"
    assert choice.gflops and set(choice.gflops) == set(first.gflops)
    assert choice.torch_dtype == torch.float32 and f"float32/{choice.linear_kernel}" in choice.gflops
    (entry,) = json.loads(cache.read_text()).values()
    assert set(entry) == {"dtype", "linear_kernel", "gflops", probe.BUSY}, "the repaired entry replaced it"
    monkeypatch.setattr(probe, "measure", lambda *a, **k: pytest.fail("the repaired entry was not used"))
    assert choose_kernels(SHAPES, 4, [torch.float32], None, cache) == choice


def test_bad_linear_kernel_names_the_field(tiny_llama_dir):
    with pytest.raises(ValueError, match="linear_kernel"):
        LLM(model=str(tiny_llama_dir), linear_kernel="fastest", show_progress=False)


def test_the_probe_times_a_huge_matrix_as_a_narrower_one(monkeypatch):
    """A 1B model's LM head (2048 x 128k) in every candidate at once would take gigabytes: the probe holds
    at most PROBE_MAX_ELEMENTS weights of each matrix, and counts it more times to keep the FLOPs."""
    seen = []
    real = probe.make_linear

    def spy(w, *args, **kwargs):
        seen.append(tuple(w.shape))
        return real(w, *args, **kwargs)

    monkeypatch.setattr(probe, "make_linear", spy)
    monkeypatch.setattr(probe, "PROBE_MAX_ELEMENTS", 1 << 16)
    gflops = probe.measure([(256, 4096, 1), (64, 32, 3)], 4, [(torch.float32, "aten")], rounds=1)
    assert seen == [(256, 256), (32, 64)]  # [n, k]: the wide one cut to 2^16 weights, the small one whole
    assert gflops["float32/aten"] > 0
