"""The fused decode step (`csrc/decode_layers.c`): every layer of a small decode batch in one C call
gives the layer-by-layer path's tokens and logprobs exactly, is used where it applies, and stays off
where it cannot apply or `enforce_eager` is set."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import write_mixed_llama_gguf

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.entrypoints.engine_args import add_engine_args, engine_config_from_args
from forerun.kernels.decode import GREEDY_MAX_ROWS
from tests.conftest import save_tiny_model

# Prompt lengths around the 16-token block; max_tokens differ so the batch shrinks from 6 rows
# (above the fused step's 4) to 1 within one run, and contexts cross block boundaries.
PROMPTS = [[7, 8, 9] * 7, [30, 31], list(range(50, 90)), [5] * 16, [11, 12, 13], list(range(200, 233))]
MAX_TOKENS = [30, 12, 22, 8, 26, 18]


def _run(folder, eager: bool, dtype: str = "float32", whole_steps: list | None = None, **kw) -> tuple[list, int]:
    """(tokens and logprobs per prompt, fused calls) for one engine; `whole_steps` collects the fused
    calls that ran from token ids to the logits (decode_step_f32)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]
    kw.setdefault("gemv_max_rows", 4)
    with LLM(model=str(folder), dtype=dtype, enforce_eager=eager, show_progress=False, **kw) as llm:
        fused = llm.engine.core.executor.worker.model.decode_layers
        assert (fused is None) == eager
        calls: list = []
        whole = [] if whole_steps is None else whole_steps
        if fused is not None:
            run, run_whole = fused.fn, fused._step_fn
            fused.fn = lambda *a: calls.append(1) or run(*a)
            fused._step_fn = lambda *a: calls.append(1) or whole.append(1) or run_whole(*a)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(calls)


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8}),
                                             ("llama", {"num_key_value_heads": 4})])
def test_fused_step_matches_layer_by_layer_exactly(tmp_path, smollm2_dir, arch, overrides):
    # bf16-stored weights give every matmul an exact compact form, as a bf16 checkpoint does.
    folder = save_tiny_model(tmp_path / arch, smollm2_dir, arch, stored_dtype="bfloat16", **overrides)
    eager, _ = _run(folder, eager=True)
    whole: list = []
    fused, calls = _run(folder, eager=False, whole_steps=whole)
    assert fused == eager  # token ids and every logprob, bit for bit
    # one call per decode step of at most 4 rows: about 18 once the batch has shrunk to 4; in fp32 each
    # runs the whole step, from the embedding (a dense fp32 table here) to the logits
    assert calls >= 12 and len(whole) == calls


# The bf16 module path rounds after every op and the fused step keeps fp32 between ops, so they agree
# within bf16 rounding only: on these tiny random models (flat distributions, bf16-rounded logits) the
# bf16 module path itself is up to 0.33 nats off the fp32 engine and its greedy tokens part from fp32's
# on half the prompts. A wrong cache or layout would be off by nats.
BF16_LOGPROB_TOL = 0.35


def _same_context_deviation(a: list, b: list) -> tuple[float, int]:
    """(largest logprob difference, positions compared) over the positions whose context both runs
    share: every position up to and including the first where their greedy tokens part."""
    worst, compared = 0.0, 0
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(a, b):
        for ta, tb, la, lb in zip(tokens_a, tokens_b, lps_a, lps_b):
            worst = max([worst, *(abs(la[t] - lb[t]) for t in la.keys() & lb.keys())])
            compared += 1
            if ta != tb:
                break
    return worst, compared


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("mistral", {"sliding_window": 8})])
def test_bf16_fused_step_matches_layer_by_layer_within_bf16_rounding(tmp_path, smollm2_dir, arch, overrides):
    # A bf16 engine: the fused step runs fp32 over a bf16 KV cache (forerun.kernels.decode).
    folder = save_tiny_model(tmp_path / arch, smollm2_dir, arch, stored_dtype="bfloat16", **overrides)
    eager, _ = _run(folder, eager=True, dtype="bfloat16")
    fused, calls = _run(folder, eager=False, dtype="bfloat16")
    assert calls >= 12
    worst, compared = _same_context_deviation(eager, fused)
    assert compared >= 40, "most decode steps compared"
    assert worst <= BF16_LOGPROB_TOL, f"logprobs differ by {worst:.2e}"


MIX = (Q.Q4_K, Q.Q5_0, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q5_1, Q.Q6_K)


@pytest.mark.parametrize("mode", ["default", "invariant", "int16", "int8"])
def test_fused_step_runs_packed_layers_in_several_formats(tmp_path, monkeypatch, mode):
    # As in SmolLM2's Q4_K_M file: q, k and v, and gate and up, are each in their own format, so the
    # packed matmuls are joined from one block GEMV a part, in C as in the module path. Batch-invariant
    # mode keeps the block GEMV (the lane matmul sums in its order) and never splits attention. With integer
    # activations every part here runs that GEMV (its formats include these K-quants).
    path = write_mixed_llama_gguf(tmp_path / "mixed.gguf", MIX, seed=5)
    kw: dict = {"default": {}, "invariant": {"batch_invariant": True, "gemv_max_rows": None},
                "int16": {"activation_bits": 16}, "int8": {"activation_bits": 8}}[mode]
    if mode == "invariant":  # the mode measures its GEMV crossover (gemv_max_rows is refused): pin 4 rows
        monkeypatch.setattr("forerun.worker.worker.choose_gemv_rows", lambda *a, **k: (4, {}))
    eager, _ = _run(path, eager=True, **kw)
    whole: list = []
    fused, calls = _run(path, eager=False, whole_steps=whole, **kw)
    assert calls >= 12 and len(whole) == calls  # the whole step: its embedding is a table of blocks
    assert fused == eager  # token ids and every logprob, bit for bit
    assert len({t for tokens, _ in eager for t in tokens}) > 3  # the random model says more than one thing


def test_whole_step_hands_over_its_logits_and_refuses_bad_ids(tmp_path):
    # Each whole step computes its rows' logits in the same call; the model hands them over instead of
    # running the LM head again (the tokens above equal the module path's, so they are the same logits).
    path = write_mixed_llama_gguf(tmp_path / "mixed.gguf", MIX, seed=5)
    with LLM(model=str(path), dtype="float32", gemv_max_rows=4, show_progress=False) as llm:
        model = llm.engine.core.executor.worker.model
        fused, head = model.decode_layers, model.lm_head
        handed, heads, steps = [], [], []
        logits_of, run_head, step = fused.logits_of, head.forward, fused.step
        fused.logits_of = lambda h: (lambda out: handed.append(out is not None) or out)(logits_of(h))
        head.forward = lambda h: heads.append(h.shape[0]) or run_head(h)
        fused.step = lambda *a: steps.append(a) or step(*a)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert len(steps) == 11 and handed.count(True) == 11  # every decode step's logits came from the step
        assert heads == [1]  # the head ran once, for the prompt's last token
        ids, positions, caches, meta = steps[-1]
        bad = ids.clone()
        bad[0] = model.args.vocab_size
        with pytest.raises(ValueError, match="input_ids"):
            step(bad, positions, caches, meta)
        far = positions.clone()
        far[0] = model.model.rotary.table.shape[0]
        with pytest.raises(ValueError, match="positions"):
            step(ids, far, caches, meta)


def test_whole_step_gives_greedy_sampling_the_argmax_of_its_logits(tmp_path):
    # Steps of up to GREEDY_MAX_ROWS rows also compute each row's argmax while the logits are in cache,
    # and greedy sampling takes those ids; larger steps leave the argmax to the sampler.
    path = write_mixed_llama_gguf(tmp_path / "mixed.gguf", MIX, seed=5)
    prompts = [[5 + i, 6, 7] for i in range(GREEDY_MAX_ROWS + 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    with LLM(model=str(path), dtype="float32", gemv_max_rows=16, show_progress=False) as llm:
        model = llm.engine.core.executor.worker.model
        seen: list = []
        greedy_ids = model.greedy_ids
        model.greedy_ids = lambda logits: (lambda ids: seen.append((logits.clone(), ids)) or ids)(greedy_ids(logits))
        outs = llm.generate(prompts, params, use_tqdm=False)
    small = [(logits, ids) for logits, ids in seen if logits.shape[0] <= GREEDY_MAX_ROWS]
    large = [ids for logits, ids in seen if logits.shape[0] > GREEDY_MAX_ROWS]
    assert len(small) >= 10 and len(large) >= 2  # the batch shrank from 10 rows to 1
    assert all(ids is not None and torch.equal(ids, logits.argmax(-1)) for logits, ids in small)
    assert large == [None] * len(large)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


def test_integer_activations_change_results_within_their_rounding(tmp_path):
    # The setting must act: integer activations give other logprobs than fp32 (not bit-equal), yet
    # close: 8 bits within 0.1, 16 bits within 1e-3 and far closer than 8.
    path = write_mixed_llama_gguf(tmp_path / "mixed.gguf", MIX, seed=5)
    fp32, _ = _run(path, eager=False)
    worst = {}
    for bits in (16, 8):
        out, _ = _run(path, eager=False, activation_bits=bits)
        assert out != fp32
        worst[bits], compared = _same_context_deviation(fp32, out)
        assert compared >= 40
    assert worst[8] <= 0.1 and worst[16] <= 1e-3 and worst[16] * 20 < worst[8], worst


def test_integer_activations_reach_every_part_whose_format_has_the_gemv(tmp_path, monkeypatch):
    # Every block GEMV the engine builds for this file's formats (K-quants included) takes integer
    # activations of the width asked, and none otherwise (the tied head is Q8_0, so the logprob test
    # above would pass with the K-quant parts left on fp32).
    from forerun.kernels.kquant_gemv import KQuantGemv
    built: list = []
    init = KQuantGemv.__init__
    monkeypatch.setattr(KQuantGemv, "__init__",
                        lambda self, *a, **k: init(self, *a, **k) or built.append((self.fmt, self.activation_bits)))
    path = write_mixed_llama_gguf(tmp_path / "mixed.gguf", MIX, seed=5)
    for bits in (16, 8, 32):
        built.clear()
        with LLM(model=str(path), dtype="float32", gemv_max_rows=4, activation_bits=bits, show_progress=False):
            pass
        assert {fmt for fmt, _ in built} >= {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
        assert all(got == bits for _, got in built), built


def test_no_fused_step_where_it_cannot_apply(tmp_path, smollm2_dir, caplog):
    folder = save_tiny_model(tmp_path / "qwen3", smollm2_dir, "qwen3", stored_dtype="bfloat16")
    with caplog.at_level(logging.INFO):
        with LLM(model=str(folder), dtype="float32", gemv_max_rows=4, show_progress=False) as llm:
            assert llm.engine.core.executor.worker.model.decode_layers is None
            assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    assert "layer by layer (per-head q/k norms)" in caplog.text
    # fp32 weights that bf16 cannot hold: no compact forms, so no GEMV and no fused step
    folder = save_tiny_model(tmp_path / "fp32", smollm2_dir)
    with LLM(model=str(folder), dtype="float32", gemv_max_rows=4, show_progress=False) as llm:
        assert llm.engine.core.executor.worker.model.decode_layers is None


def test_enforce_eager_flag_and_validation():
    import argparse

    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args(["--activation-bits", "8"])).activation_bits == 8
    assert engine_config_from_args(parser.parse_args([])).activation_bits is None
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_config_from_args(parser.parse_args([])).enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes").validate()
