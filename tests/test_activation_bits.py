"""Who decides the width of a GGUF model's small-matmul activations (`activation_bits`): 16 by default
where `dtype="auto"` is measured, batch invariance is off and the int16 probe finds the 16-bit GEMV
faster; fp32 (32) wherever a dtype is given or pinned, invariance is on, or the probe finds no gain; a
width asked for is kept. The probe itself times real kernels and caches its answer. On the bundled
model 16 bits keep fp32 products' greedy tokens (8 bits do not). (The kernel's arithmetic:
tests/test_int_gemv.py; the engine's results under each width: tests/test_native_decode.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf_factory import write_mixed_llama_gguf

from forerun import LLM, SamplingParams
from forerun.kernels import int_probe
from forerun.kernels.block_probe import BF16_BLOCKS, FP32_BLOCKS, LANES, decide
from forerun.kernels.build import load_native_library
from forerun.kernels.int_probe import INT16_GAIN, ActivationChoice, choose_activation_bits
from forerun.kernels.kquant_gemv import KQuantGemv
from forerun.loader.model_source import cache_dir
from forerun.worker import numerics
from forerun.worker.numerics import AUTO_DTYPES_ENV
from tests.conftest import judge_machine


@pytest.mark.parametrize("probe, cheap_invariance, settings, pinned, want", [
    (1.5, False, {}, "", 16),  # faster at one row: 16 bits unasked
    (1.0, False, {}, "", 32),  # no gain: fp32
    (1.5, True, {}, "", 32),  # batch invariance on: one fp32 order at every row count
    (1.5, False, {"dtype": "float32"}, "", 32),  # a dtype given keeps fp32 products
    (1.5, False, {}, "float32", 32),  # as does one pinned for a fleet
    (1.0, False, {"activation_bits": 8}, "", 8),  # a width asked for is kept
    (1.5, False, {"activation_bits": 32}, "", 32),
])
def test_the_default_width_follows_the_probe_and_the_settings(tmp_path: Path, monkeypatch, probe: float,
                                                              cheap_invariance: bool, settings: dict, pinned: str,
                                                              want: int) -> None:
    gflops = {LANES: 100.0, FP32_BLOCKS: 100.0 if cheap_invariance else 120.0, BF16_BLOCKS: 10.0}
    monkeypatch.setattr(numerics, "choose_block_dtype", lambda *a, **k: decide(gflops))
    asked: list = []
    monkeypatch.setattr(numerics, "choose_activation_bits", lambda *a, **k: asked.append(a) or ActivationChoice(
        16 if probe >= INT16_GAIN else 32, probe))
    if pinned:
        monkeypatch.setenv(AUTO_DTYPES_ENV, pinned)
    else:
        monkeypatch.delenv(AUTO_DTYPES_ENV, raising=False)
    built: list = []
    init = KQuantGemv.__init__
    monkeypatch.setattr(KQuantGemv, "__init__",
                        lambda self, *a, **k: init(self, *a, **k) or built.append(self.activation_bits))
    path = write_mixed_llama_gguf(tmp_path / "mixed.gguf", (Q.Q4_K, Q.Q5_0, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_1, Q.Q6_K), seed=3,
                                  max_positions=256)
    with LLM(model=str(path), max_model_len=256, show_progress=False, **settings) as llm:
        assert llm.engine.core.executor.worker.batch_invariant is (cheap_invariance and not settings)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 4
    assert built and set(built) == {want}, built
    # the probe runs only where its answer decides the width
    assert bool(asked) == (not settings and not pinned and not cheap_invariance)


def test_probe_times_the_kernels_and_caches_its_answer(tmp_path: Path, monkeypatch) -> None:
    judge_machine(monkeypatch, False)  # a busy verdict would make the cached answer be measured again
    lib = load_native_library(cache_dir() / "kernels")
    assert lib is not None
    shapes = [(576, 1536, 30), (1536, 576, 30)]
    cache = tmp_path / "probe.json"
    first = choose_activation_bits(lib, shapes, "Q4_K", cache)
    assert first.speedup > 0 and first.bits == (16 if first.speedup >= INT16_GAIN else 32)
    monkeypatch.setattr(int_probe, "measure_int16_speedup", lambda *a, **k: pytest.fail("measured again"))
    assert choose_activation_bits(lib, shapes, "Q4_K", cache) == first
    # a format without the GEMV stays fp32, unmeasured
    assert choose_activation_bits(lib, shapes, "Q2_K", cache) == ActivationChoice(32, 0.0)


def test_probe_times_every_matmul_at_full_width_with_the_same_work() -> None:
    # A small matrix timed at its own width is mostly Python's per-call cost, which the one-call decode
    # step does not pay: every shape is timed as a matrix of the probe's cap, its count scaled to match.
    for k, n, count in [(576, 576, 30), (576, 49152, 1), (8192, 2048, 16)]:
        k2, n2, count2 = int_probe.full_width(k, n, count)
        assert k2 == k and k2 * n2 <= int_probe.PROBE_MAX_ELEMENTS < k2 * (n2 + 1)
        assert n2 * count2 == pytest.approx(n * count)


def test_sixteen_bits_keep_the_bundled_models_greedy_tokens(smollm2_dir: Path) -> None:
    # What makes 16 bits a default: on the bundled model the greedy tokens are those of fp32 products
    # and the logprobs within 1e-2 (8 bits change this model's answers: docs/cpu-kernels.md).
    prompts = ["What is the capital of France?", "Write a haiku about autumn.", "Why is the sky blue?",
               "List three prime numbers.", "How do I boil an egg?", "Who wrote Hamlet?"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    runs = {}
    for bits in (32, 16):
        # fp32 between the matmuls, whatever the machine's dtype choice: bf16 rounds after every op, and
        # any change to the inputs of those roundings moves tokens (a CPU with avx512_bf16 may pick it).
        with LLM(model=str(smollm2_dir), dtype="float32", activation_bits=bits, batch_invariant=False,
                 gemv_max_rows=8, show_progress=False) as llm:
            runs[bits] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    worst = 0.0
    for fp32, int16 in zip(runs[32], runs[16], strict=True):
        assert int16.token_ids == fp32.token_ids
        for a, b, token in zip(fp32.logprobs, int16.logprobs, fp32.token_ids, strict=True):
            worst = max(worst, abs(a[token] - b[token]))
    assert 0.0 < worst <= 1e-2, worst  # rounded (not the fp32 bits), yet close
