"""GGUF conversion: de-quantization, tensor layout, config and tokenizer, checked against transformers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import CHAT_TEMPLATE, write_model_gguf
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from forerun.loader.gguf_convert import describe_gguf, export_hf_folder
from forerun.loader.gguf_tensors import dequantize_tensor
from forerun.loader.model_source import default_model_gguf

TRICKY = [
    "The capital of France is",
    "12345 and 3.14159 or 1,000,000",
    "  leading spaces,   inner  runs, trailing   ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "héllo 🙂 naïve café — 日本語",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "it's we'll they're I'M",
]


# ---------------------------------------------------------------- de-quantization of small tensors

def _reference_dequant(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    """Block formats decoded straight from ggml's layout description, independent of gguf.quants."""
    if qtype == Q.F32:
        return raw.reshape(shape)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if qtype == Q.Q8_0:
        return (d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape)
    start = 2 if qtype == Q.Q4_0 else 4
    nibbles = blocks[:, start:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)  # low halves first
    if qtype == Q.Q4_0:
        return (d * (q - 8)).reshape(shape)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(shape)


# Worst-case error of each format relative to a 32-value block's absolute maximum (with fp16 scales).
_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1 / 127 * 0.51 + 1e-3,
              Q.Q4_0: 1 / 7 * 1.01, Q.Q4_1: 2 / 15 * 0.51 + 1e-3}


def _write_single_tensor(path: Path, name: str, raw: np.ndarray, qtype: Q) -> gguf.ReaderTensor:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(path).tensors[0]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_matches_reference(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    shape = (6, 96)  # non-square so a transposed result cannot pass
    values = (rng.standard_normal(shape) * np.linspace(0.1, 3.0, shape[1])).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    tensor = _write_single_tensor(tmp_path / "t.gguf", "blk.0.ffn_up.weight", raw, qtype)
    assert tensor.shape.tolist() == [96, 6]  # GGUF lists the innermost dimension first
    out = dequantize_tensor(tensor)
    assert out.dtype == np.float32 and out.shape == shape
    np.testing.assert_array_equal(out, _reference_dequant(np.asarray(raw).reshape(-1), qtype, shape))
    block_max = np.abs(values).reshape(-1, 32).max(axis=1, keepdims=True)
    err = np.abs(out - values).reshape(-1, 32)
    assert np.all(err <= _TOLERANCE[qtype] * block_max + 1e-7)


def test_unsupported_type_names_tensor_and_type(tmp_path: Path) -> None:
    raw = np.zeros((2, 66), dtype=np.uint8)  # two IQ2_XXS blocks of 256 values, 66 bytes each
    path = tmp_path / "iq2xxs.gguf"
    _write_single_tensor(path, "blk.0.ffn_up.weight", raw, Q.IQ2_XXS)
    with pytest.raises(ValueError, match=r"IQ2_XXS.*blk\.0\.ffn_up\.weight.*supported: .*Q4_K"):
        describe_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


# ---------------------------------------------------------------- tiny synthetic models, all three families

def _tiny_model(arch: str, tied: bool) -> torch.nn.Module:
    common = dict(vocab_size=266, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(rope_theta=50000.0, **common)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(rope_theta=50000.0, **common)).eval()
    model = Qwen3ForCausalLM(Qwen3Config(rope_theta=50000.0, **common)).eval()
    with torch.no_grad():  # q/k norms start at one; make them matter
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize(("arch", "tied", "hf_class"), [
    ("llama", True, LlamaForCausalLM), ("llama", False, LlamaForCausalLM),
    ("qwen2", False, Qwen2ForCausalLM), ("qwen3", True, Qwen3ForCausalLM)])
def test_tiny_model_round_trip(tmp_path: Path, arch: str, tied: bool, hf_class: type) -> None:
    original = _tiny_model(arch, tied)
    if arch == "qwen2":
        with torch.no_grad():  # non-zero q/k biases, so a missed permutation or bias would show
            for layer in original.model.layers:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
    write_model_gguf(tmp_path / "m.gguf", original, arch)
    out = tmp_path / "hf"
    export_hf_folder(tmp_path / "m.gguf", out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [hf_class.__name__] and config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied and config["head_dim"] == 16
    assert config["num_key_value_heads"] == 2 and config["rope_theta"] == 50000.0
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) is not tied
    converted = hf_class.from_pretrained(out).eval()
    ids = torch.tensor([[5, 77, 140, 3, 9, 200, 31]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=0, atol=1e-5)


def test_mixture_of_experts_is_refused_by_its_field(tmp_path: Path) -> None:
    # Mixtral-style files name their architecture "llama"; the expert count, not a tensor, says why.
    write_model_gguf(tmp_path / "m.gguf", _tiny_model("llama", True), "llama", fields={"llama.expert_count": 8})
    with pytest.raises(ValueError, match="llama.expert_count is 8: mixture-of-experts"):
        describe_gguf(tmp_path / "m.gguf", tmp_path / "out")


def test_tiny_tokenizer_files(tmp_path: Path) -> None:
    write_model_gguf(tmp_path / "m.gguf", _tiny_model("llama", True), "llama")
    export_hf_folder(tmp_path / "m.gguf", tmp_path / "hf")
    tok = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    enc = tok.encode("<|im_start|> the")
    assert enc.tokens == ["<|im_start|>", "Ġthe"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == " the"
    cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert (cfg["bos_token"], cfg["eos_token"], cfg["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    # EOS (<|im_end|>) and the control token <|endoftext|>, which also ends generation (tests/test_gguf_stops.py)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == [0, 2]


# ---------------------------------------------------------------- the real default model (converted once)

@pytest.fixture(scope="session")
def smollm_dir(smollm2_hf_dir: Path) -> Path:
    return smollm2_hf_dir


@pytest.fixture(scope="session")
def gguf_tokenizer() -> object:
    path = default_model_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_smollm_greedy_paris(smollm_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(smollm_dir).eval()
    tok = Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    ids = torch.tensor([tok.encode("The capital of France is").ids])
    out = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:].tolist()).startswith(" Paris")


def test_smollm_logits_match_transformers_gguf_loader(smollm_dir: Path) -> None:
    ours = LlamaForCausalLM.from_pretrained(smollm_dir).eval()
    path = default_model_gguf()
    start = time.monotonic()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert time.monotonic() - start < 120, "transformers' GGUF loader took unexpectedly long"
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 30, 216, 17]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("text", TRICKY)
def test_smollm_tokenizer_matches_transformers(smollm_dir: Path, gguf_tokenizer: object, text: str) -> None:
    tok = Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids == gguf_tokenizer(text)["input_ids"]  # type: ignore[operator]
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_smollm_tokenizer_details(smollm_dir: Path) -> None:
    tok = Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    # Like the real SmolLM2 tokenizer: every digit is its own piece, control tokens are atomic.
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert "Digits" in json.dumps(json.loads(tok.to_str())["pre_tokenizer"])
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.decode(tok.encode("<|im_end|>hi").ids, skip_special_tokens=True) == "hi"
    folder_tok = AutoTokenizer.from_pretrained(smollm_dir)
    assert folder_tok.eos_token == "<|im_end|>" and folder_tok.bos_token == "<|im_start|>"
    chat = folder_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
