"""The rotary fields of GGUF files: Llama 3.1-style rope scaling (Llama 3.1, 3.2, 3.3 downloads), and
the shapes forerun's rotary embedding does not compute, refused.

llama.cpp's converter does not write the llama3 `rope_scaling` parameters into the metadata: it writes
one divisor per rotary frequency as the tensor rope_freqs.weight. The reference here is transformers
running the Hugging Face model with the llama3 scaling those divisors came from; forerun runs the GGUF
file, which holds the same weights and only the divisors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import write_model_gguf
from safetensors.numpy import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from forerun import LLM, SamplingParams
from forerun.loader.gguf_convert import describe_gguf, export_hf_folder
from forerun.model.rotary import RotaryEmbedding
from tests.hf_reference import hf_greedy, hf_prompt_logprobs

THETA, HEAD_DIM, MAX_POS = 10000.0, 16, 160
# A short original context, so that positions past it are reached in a test: frequencies whose
# wavelength is under 32 / 4 = 8 positions keep their speed, those over 32 turn 8x slower, the band
# between blends (with head_dim 16 the eight frequencies cover all three).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def llama3_divisors(head_dim: int, theta: float, factor: float, low: float, high: float,
                    original: float) -> np.ndarray:
    """What llama.cpp's converter writes for a llama3 scaling, from its definition: per frequency the
    ratio of the unscaled speed to the scaled one (1 for short wavelengths, `factor` for long ones, the
    reciprocal of the linear blend between)."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blend = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blend))
    return divisors.astype(np.float32)


def _divisors() -> np.ndarray:
    return llama3_divisors(HEAD_DIM, THETA, *(float(LLAMA3[k]) for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))


def _hf_model(scaled: bool) -> LlamaForCausalLM:
    rope = {"rope_theta": THETA, **(LLAMA3 if scaled else {"rope_type": "default"})}
    config = LlamaConfig(vocab_size=266, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, rope_parameters=rope)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than at initialisation, so that positions matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scaled model as a Hugging Face folder and as a GGUF with rope_freqs.weight, and the same
    weights as a Hugging Face folder without scaling."""
    root = tmp_path_factory.mktemp("rope_freqs")
    scaled, plain = _hf_model(True), _hf_model(False)
    plain.load_state_dict(scaled.state_dict())
    scaled.save_pretrained(root / "hf")
    plain.save_pretrained(root / "hf_plain")
    divisors = _divisors()
    assert len(set(divisors.tolist())) > 2 and divisors.min() == 1.0 and divisors.max() == 8.0  # every regime
    write_model_gguf(root / "m.gguf", scaled, "llama", rope_freqs=divisors)
    return {"hf": root / "hf", "hf_plain": root / "hf_plain", "gguf": root / "m.gguf"}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 266, size=n).tolist() for n in (90, 140)]  # well past the original 32 positions


def test_rotary_table_is_the_llama3_one(files: dict[str, Path], tmp_path: Path) -> None:
    describe_gguf(files["gguf"], tmp_path / "described")
    scaling = json.loads((tmp_path / "described" / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "freq_factors" and len(scaling["factors"]) == HEAD_DIM // 2
    ours = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, scaling).table
    want = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, LLAMA3).table  # forerun's llama3, checked against HF below
    unscaled = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA).table
    torch.testing.assert_close(ours, want, rtol=0, atol=2e-5)
    assert (ours - unscaled).abs().max() > 0.5  # the divisors act


def test_gguf_with_rope_freqs_matches_transformers_llama3(files: dict[str, Path]) -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    with LLM(model=str(files["gguf"]), dtype="float32", show_progress=False) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(files["hf"], prompts, 12)
    scaled, plain = hf_prompt_logprobs(files["hf"], prompts), hf_prompt_logprobs(files["hf_plain"], prompts)
    for ids, out, want, other in zip(prompts, outs, scaled, plain):
        got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        at = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
        torch.testing.assert_close(got, want[at], rtol=0, atol=1e-4)
        assert (got - other[at]).abs().max() > 0.05  # without the scaling the file would read differently


def test_quantized_gguf_with_rope_freqs_matches_transformers(files: dict[str, Path], tmp_path: Path) -> None:
    """Q8_0 matrices, read as blocks by the compact GEMV and the fused decode step, against transformers
    with the llama3 scaling over the same weights de-quantized (fp32 products: activation_bits=32; the
    GEMV, and so the fused step, for up to 8 rows whatever this machine's probe found)."""
    write_model_gguf(tmp_path / "q8.gguf", _hf_model(True), "llama", qtype=Q.Q8_0, rope_freqs=_divisors())
    assert {t.tensor_type for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors if len(t.shape) == 2} == {Q.Q8_0}
    export_hf_folder(tmp_path / "q8.gguf", tmp_path / "export")
    reference = _hf_model(True)
    missing, unexpected = reference.load_state_dict(
        {k: torch.from_numpy(v) for k, v in load_file(str(tmp_path / "export" / "model.safetensors")).items()},
        strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    reference.save_pretrained(tmp_path / "hf_q8")
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    with LLM(model=str(tmp_path / "q8.gguf"), dtype="float32", activation_bits=32, gemv_max_rows=8,
             show_progress=False) as llm:
        assert llm.engine.core.executor.worker.model.decode_layers is not None  # the fused step runs
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tmp_path / "hf_q8", prompts, 12)
    for ids, out, want in zip(prompts, outs, hf_prompt_logprobs(tmp_path / "hf_q8", prompts)):
        got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
        torch.testing.assert_close(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], rtol=0, atol=1e-4)


def test_rope_freqs_of_the_wrong_size_or_sign_is_refused(tmp_path: Path) -> None:
    model = _hf_model(True)
    for name, divisors, message in (("short", np.ones(HEAD_DIM // 2 - 1), "holds 7 factors"),
                                    ("zero", np.r_[np.ones(HEAD_DIM // 2 - 1), 0.0], "positive finite"),
                                    ("nan", np.r_[np.ones(HEAD_DIM // 2 - 1), np.nan], "positive finite")):
        write_model_gguf(tmp_path / f"{name}.gguf", model, "llama", rope_freqs=divisors)
        with pytest.raises(ValueError, match=f"rope_freqs.weight.*{message}|{message}.*"):
            describe_gguf(tmp_path / f"{name}.gguf", tmp_path / name)


@pytest.mark.parametrize("key", ["llama.rope.dimension_count", "llama.attention.value_length"])
def test_partial_rotary_or_other_value_size_is_refused(tmp_path: Path, key: str) -> None:
    write_model_gguf(tmp_path / "m.gguf", _hf_model(False), "llama", fields={key: HEAD_DIM // 2})
    with pytest.raises(ValueError, match=f"{key} is {HEAD_DIM // 2}; .* head size {HEAD_DIM}"):
        describe_gguf(tmp_path / "m.gguf", tmp_path / "described")
    write_model_gguf(tmp_path / "ok.gguf", _hf_model(False), "llama", fields={key: HEAD_DIM})  # as llama.cpp writes it
    describe_gguf(tmp_path / "ok.gguf", tmp_path / "ok")


def test_the_rotary_table_holds_the_engines_positions_only(files: dict[str, Path], tmp_path: Path) -> None:
    """A file's context can far exceed what the engine runs (Llama 3.x: 131,072 positions, 64 MB of table
    at head_dim 64): the table keeps max_model_len positions, and the last of them decodes as before."""
    write_model_gguf(tmp_path / "q8.gguf", _hf_model(True), "llama", qtype=Q.Q8_0, rope_freqs=_divisors())
    prompt = np.random.default_rng(3).integers(3, 266, size=52).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)  # positions 52 .. 63
    outs = {}
    for limit in (None, 64):
        with LLM(model=str(tmp_path / "q8.gguf"), dtype="float32", activation_bits=32, gemv_max_rows=8,
                 max_model_len=limit, show_progress=False) as llm:
            model = llm.engine.core.executor.worker.model
            assert model.model.rotary.table.shape[0] == (limit or MAX_POS)
            assert model.decode_layers is not None and model.decode_layers.ends.rotary is model.model.rotary.table
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            outs[limit] = (list(out.token_ids), [dict(lp) for lp in out.logprobs])
    assert outs[64] == outs[None] and len(outs[64][0]) == 12
