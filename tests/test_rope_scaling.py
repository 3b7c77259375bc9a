"""Rope scaling that extends a model's context: linear position interpolation (DeepSeek-Coder) and YaRN
(the long-context Qwen2.5 and Qwen3 variants), from a Hugging Face config and from a GGUF file's
rope.scaling.* fields, read as llama.cpp reads them.

The reference is transformers running the Hugging Face model with the same scaling; forerun runs that
folder and the GGUF file written from the same weights.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_factory import write_model_gguf
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from forerun import LLM, SamplingParams
from forerun.loader.gguf_convert import describe_gguf
from forerun.model.positions import model_positions
from forerun.model.rotary import RotaryEmbedding
from tests.hf_reference import hf_greedy, hf_prompt_logprobs

THETA, HEAD_DIM, MAX_POS = 10000.0, 16, 160
# A short original context, so that the prompts below run well past it. With head_dim 16 and YaRN's
# default betas (32, 1) over 32 positions, frequency 0 keeps its speed, frequency 1 blends and the
# rest turn `factor` times slower.
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# As Qwen2.5's and Qwen3's configs turn YaRN on: max_position_embeddings stays the original context, and
# the model admits `factor` times as many positions (the prompts below run past 40, up to 152).
STRETCH_POS = 40
STRETCH = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": STRETCH_POS}


def _hf_model(family: str, scaling: dict[str, Any] | None, max_pos: int = MAX_POS) -> torch.nn.Module:
    rope = {"rope_theta": THETA, **(scaling or {"rope_type": "default"})}
    common = dict(vocab_size=266, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=max_pos, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rope_parameters=rope)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    with torch.no_grad():  # sharper attention than at initialisation, so that positions matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def _hf_cos_sin(scaling: dict[str, Any], rows: int = MAX_POS) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin [rows, HEAD_DIM] for `scaling` (its attention factor applied)."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                         rope_parameters={"rope_theta": THETA, **scaling})
    inv_freq, attention = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    angles = torch.outer(torch.arange(rows, dtype=torch.float32), inv_freq.float())
    both = torch.cat((angles, angles), dim=-1)
    return both.cos() * attention, both.sin() * attention


@pytest.mark.parametrize("scaling", [
    LINEAR, YARN,
    {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    {**YARN, "attention_factor": 1.5},
    {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}], ids=["linear", "yarn", "yarn-betas", "yarn-attention",
                                                            "yarn-mscale"])
def test_rotary_table_is_transformers(scaling: dict[str, Any]) -> None:
    table = RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, scaling).table
    cos, sin = _hf_cos_sin(scaling)
    half = HEAD_DIM // 2
    torch.testing.assert_close(table[:, :HEAD_DIM], cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(table[:, HEAD_DIM:HEAD_DIM + half], -sin[:, :half], rtol=0, atol=2e-5)
    torch.testing.assert_close(table[:, HEAD_DIM + half:], sin[:, half:], rtol=0, atol=2e-5)
    assert (table - RotaryEmbedding(HEAD_DIM, MAX_POS, THETA).table).abs().max() > 0.5  # the scaling acts


def test_the_table_holds_the_positions_asked_for() -> None:
    """A long context's table is not built whole with the model (Mistral NeMo: 1,024,000 positions): it
    starts at 8,192 positions and takes the engine's max_model_len, keeping its dtype."""
    rope = RotaryEmbedding(HEAD_DIM, 20000, THETA, YARN)
    first = rope.table.clone()
    assert first.shape == (8192, 2 * HEAD_DIM)
    assert rope.resize(12000) and rope.table.shape[0] == 12000
    torch.testing.assert_close(rope.table[:8192], first, rtol=0, atol=0)
    cos, sin = _hf_cos_sin(YARN, 12000)  # angles up to 12,000 radians: float32 rounding of ~1e-3
    torch.testing.assert_close(rope.table[8192:, :HEAD_DIM], cos[8192:], rtol=0, atol=2e-3)
    torch.testing.assert_close(rope.table[8192:, HEAD_DIM + HEAD_DIM // 2:], sin[8192:, HEAD_DIM // 2:], rtol=0,
                               atol=2e-3)
    assert not rope.resize(12000) and rope.resize(30000) and rope.table.shape[0] == 20000  # at most the model's
    rope.to(torch.bfloat16)
    assert rope.resize(100) and rope.table.dtype == torch.bfloat16 and rope.table.shape[0] == 100
    assert rope.resize(9000) and rope.table.dtype == torch.bfloat16
    torch.testing.assert_close(rope.table[:8192].float(), first.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_unknown_rope_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="rope_scaling: unsupported rope_type 'longrope'"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, {"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling: yarn needs original_max_position_embeddings"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, THETA, {"rope_type": "yarn", "factor": 4.0})


def _gguf_fields(arch: str, scaling: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's converter writes for `scaling`."""
    fields: dict[str, Any] = {f"{arch}.rope.scaling.type": scaling["rope_type"],
                              f"{arch}.rope.scaling.factor": float(scaling["factor"])}
    if "original_max_position_embeddings" in scaling:
        fields[f"{arch}.rope.scaling.original_context_length"] = scaling["original_max_position_embeddings"]
    return fields


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 266, size=n).tolist() for n in (90, 140)]  # well past the original 32 positions


@pytest.mark.parametrize(("family", "scaling", "max_pos"),
                         [("llama", LINEAR, MAX_POS), ("qwen2", YARN, MAX_POS), ("qwen2", STRETCH, STRETCH_POS)],
                         ids=["linear", "yarn", "yarn-stretches-the-context"])
def test_scaled_model_matches_transformers(tmp_path: Path, family: str, scaling: dict[str, Any],
                                           max_pos: int) -> None:
    """The Hugging Face folder and the GGUF file of a scaled model both give transformers' greedy tokens
    and prompt logprobs; the same weights unscaled read the prompts differently. With YaRN the model
    admits its original context times the factor, where that is more than max_position_embeddings."""
    scaled, plain = _hf_model(family, scaling, max_pos), _hf_model(family, None, max_pos)
    with torch.no_grad():
        for layer in scaled.model.layers if family == "qwen2" else ():  # non-zero q/k biases
            layer.self_attn.q_proj.bias.normal_()
            layer.self_attn.k_proj.bias.normal_()
    plain.load_state_dict(scaled.state_dict())
    scaled.save_pretrained(tmp_path / "hf")
    plain.save_pretrained(tmp_path / "hf_plain")
    write_model_gguf(tmp_path / "m.gguf", scaled, family, fields=_gguf_fields(family, scaling))
    describe_gguf(tmp_path / "m.gguf", tmp_path / "described")
    shutil.copy(tmp_path / "described" / "tokenizer.json", tmp_path / "hf")  # the tiny vocabulary, for forerun
    prompts = _prompts()
    want_tokens = hf_greedy(tmp_path / "hf", prompts, 12)
    want, other = hf_prompt_logprobs(tmp_path / "hf", prompts), hf_prompt_logprobs(tmp_path / "hf_plain", prompts)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    for model in (tmp_path / "hf", tmp_path / "m.gguf"):
        with LLM(model=str(model), dtype="float32", show_progress=False) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            limit = llm.engine.core.max_model_len
        assert limit == (STRETCH_POS * 4 if scaling is STRETCH else max_pos), model.name
        assert [o.outputs[0].token_ids for o in outs] == want_tokens, model.name
        for ids, out, scaled_lp, plain_lp in zip(prompts, outs, want, other):
            got = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))])
            at = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
            torch.testing.assert_close(got, scaled_lp[at], rtol=0, atol=1e-4)
            assert (got - plain_lp[at]).abs().max() > 0.05  # without the scaling the model reads differently


@pytest.mark.parametrize(("config", "want"), [
    ({"max_position_embeddings": 4096}, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": LINEAR}, 4096),  # the config's count already stretched
    ({"max_position_embeddings": 32768, "rope_scaling": {**STRETCH, "original_max_position_embeddings": 32768}},
     131072),
    ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 131072),
    ({"max_position_embeddings": 200, "rope_parameters": {"rope_theta": THETA, **YARN}}, 200),
    ({"max_position_embeddings": 64, "rope_scaling": {**YARN, "factor": 1.0}}, 64),
    ({}, None),
], ids=["plain", "linear", "yarn", "yarn-old-key", "yarn-shorter", "yarn-factor-1", "none"])
def test_model_positions(config: dict[str, Any], want: int | None) -> None:
    assert model_positions(config) == want


def _described(tmp_path: Path, fields: dict[str, Any], family: str = "llama") -> dict[str, Any] | None:
    write_model_gguf(tmp_path / "m.gguf", _hf_model(family, None), family, fields=fields)
    describe_gguf(tmp_path / "m.gguf", tmp_path / "described")
    return json.loads((tmp_path / "described" / "config.json").read_text()).get("rope_scaling")


@pytest.mark.parametrize(("fields", "want"), [
    ({}, None),
    # llama.cpp's type is linear when the file names none, and the factor's older key counts too.
    ({"llama.rope.scaling.factor": 4.0}, LINEAR),
    ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0}, None),
    # YaRN's original context defaults to the file's; its betas and attention factor are read.
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_POS}),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 32, "llama.rope.scaling.yarn_beta_fast": 16.0,
      "llama.rope.scaling.yarn_beta_slow": 2.0, "llama.rope.scaling.attn_factor": 1.5},
     {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.5 * (1 + 0.1 * math.log(4.0))}),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 32, "llama.rope.scaling.yarn_log_multiplier": 0.5},
     # transformers' temperature with mscale 1 and mscale_all_dim 0.5, as llama.cpp reads the multiplier
     {**YARN, "attention_factor": (1 + 0.1 * math.log(4.0)) / (1 + 0.05 * math.log(4.0))}),
], ids=["plain", "factor-only", "scale-linear", "none", "linear-1", "yarn-default-context", "yarn-fields",
        "yarn-log-multiplier"])
def test_gguf_rope_scaling_fields(tmp_path: Path, fields: dict[str, Any], want: dict[str, Any] | None) -> None:
    got = _described(tmp_path, fields)
    if want is None:
        assert got is None
    else:
        assert got is not None and got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6) if isinstance(value, float) else got[key] == value, key


@pytest.mark.parametrize(("fields", "message"), [
    ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0},
     "llama.rope.scaling.type 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0, "llama.rope.scaling.attn_factor": 1.5},
     "llama.rope.scaling.attn_factor is 1.5"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.yarn_ext_factor": 0.5}, "llama.rope.scaling.yarn_ext_factor is 0.5"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0},
     "llama.rope.scaling.factor is -2.0"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": "four"},
     "llama.rope.scaling.factor is 'four'; expected a number"),
])
def test_unsupported_gguf_rope_scaling_is_refused(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        _described(tmp_path, fields)
