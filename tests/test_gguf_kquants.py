"""GGUF files mixing the k-quant, 5-bit and IQ4 formats (as llama.cpp's Q4_K_M and friends do) load
into forerun: the loaded blocks and the exported weights are gguf's reference de-quantization bit for
bit, and greedy tokens equal transformers' on the same file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_factory import gguf_name, llama_permute, random_blocks, tiny_vocab, write_model_gguf
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from forerun import LLM, SamplingParams
from forerun.kernels.compact_weights import CompactWeight
from forerun.loader.gguf_convert import describe_gguf, export_hf_folder
from forerun.loader.gguf_weights import iter_gguf_weights
from forerun.loader.gguf_tensors import dequantize_tensor
from tests.conftest import cache_sharing_kernels

LAYER_KEYS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _mix(embed: Q, output: Q, *layers: tuple[Q, ...]) -> dict[str, Q]:
    mix = {"token_embd.weight": embed, "output.weight": output}
    for i, types in enumerate(layers):
        mix.update({f"blk.{i}.{key}.weight": t for key, t in zip(LAYER_KEYS, types, strict=True)})
    return mix


MIXES = {
    # Like Q4_K_M: mostly Q4_K, attn_v / ffn_down / output in Q6_K, some Q5_K, and the legacy
    # 5- and 8-bit types llama.cpp falls back to where a row is not whole 256-blocks.
    "q4_k_m": _mix(Q.Q4_K, Q.Q6_K,
                   (Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q5_1, Q.Q6_K),
                   (Q.Q5_K, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q4_K, Q.Q5_1)),
    # The low-bit and non-linear types, with the older ones beside them.
    "low_bits": _mix(Q.Q3_K, Q.Q2_K,
                     (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.Q2_K, Q.Q3_K, Q.IQ4_XS),
                     (Q.IQ4_XS, Q.Q4_0, Q.Q4_1, Q.Q3_K, Q.BF16, Q.F16, Q.Q2_K)),
}
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}
PROMPTS = [[5, 77, 140, 3, 9, 200, 31], [100, 101, 102, 250], [42]]
NEW_TOKENS = 16


def _tiny_llama() -> LlamaForCausalLM:
    # Rows of 256 and 512 values, so every matrix is whole k-quant super-blocks.
    vocab = len(tiny_vocab()[0])
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def mixed_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kquants")
    model = _tiny_llama()
    paths = {}
    for seed, (name, mix) in enumerate(MIXES.items()):
        paths[name] = root / f"{name}.gguf"
        write_model_gguf(paths[name], model, "llama", qtypes=mix, seed=seed)
    return paths


@pytest.fixture
def forerun_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = cache_sharing_kernels(tmp_path / "cache")
    monkeypatch.setenv("FORERUN_CACHE", str(root))
    yield root


@pytest.mark.parametrize("mix", MIXES)
def test_converted_weights_are_gguf_reference_bit_for_bit(tmp_path: Path, mixed_ggufs: dict[str, Path],
                                                          mix: str) -> None:
    reader = gguf.GGUFReader(mixed_ggufs[mix])
    written = {t.name: t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    assert written == MIXES[mix]  # the factory wrote the mix asked for
    export_hf_folder(mixed_ggufs[mix], tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    model = _tiny_llama()
    for hf_name in model.state_dict():
        tensor = next(t for t in reader.tensors if t.name == gguf_name(hf_name))
        want = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        got = weights[hf_name]
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):  # back into llama.cpp's row order
            heads = model.config.num_attention_heads if "q_proj" in hf_name else model.config.num_key_value_heads
            got = llama_permute(got, heads)
        assert got.dtype == np.float32 and got.shape == want.shape, hf_name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (hf_name, tensor.tensor_type.name)
    # What the engine loads: every quantized matrix as its blocks (in Hugging Face row order), each
    # expanding to exactly the reference's weights; float tensors as they are.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for hf_name, loaded in iter_gguf_weights(mixed_ggufs[mix], config):
        quantized = MIXES[mix].get(gguf_name(hf_name)) not in (None, *FLOAT_TYPES)
        assert isinstance(loaded, CompactWeight) == quantized, hf_name
        expanded = loaded.expand() if quantized else loaded
        assert torch.equal(expanded, torch.from_numpy(weights[hf_name])), hf_name


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding by full recomputation each step (no cache, so nothing but the weights is shared)."""
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            for _ in range(n):
                x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            outs.append(x[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("mix", MIXES)
def test_greedy_tokens_match_transformers_on_the_same_gguf(forerun_cache: Path, mixed_ggufs: dict[str, Path],
                                                           mix: str) -> None:
    path = mixed_ggufs[mix]
    # transformers de-quantizes through the gguf package: an independent reading of the same file.
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    want = _hf_greedy(reference, PROMPTS, NEW_TOKENS)
    assert len({t for out in want for t in out}) > 3  # the random model says more than one thing
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", show_progress=False) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K,
                                   Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS], ids=lambda t: t.name)
def test_dequantize_tensor_reads_rows_in_torch_order(tmp_path: Path, qtype: Q) -> None:
    raw = random_blocks(qtype, 3, 512, np.random.default_rng(int(qtype)))
    data = raw.view(np.float32) if qtype == Q.F32 else raw.view(np.float16) if qtype == Q.F16 else raw
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensor = gguf.GGUFReader(tmp_path / "t.gguf").tensors[0]
    assert tensor.shape.tolist() == [512, 3]  # GGUF lists the innermost dimension first
    out = dequantize_tensor(tensor)
    want = gguf.quants.dequantize(raw, qtype).reshape(3, 512)
    assert out.dtype == np.float32 and out.shape == (3, 512)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


def test_unsupported_type_is_one_line_naming_tensor_and_type(tmp_path: Path) -> None:
    path = tmp_path / "iq2.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 66), dtype=np.uint8), raw_dtype=Q.IQ2_XXS)  # 2 rows of 256
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as err:
        describe_gguf(path, tmp_path / "out")
    message = str(err.value)
    assert message.startswith("gguf: unsupported quant type IQ2_XXS in tensor blk.0.ffn_up.weight; supported: ")
    assert "\n" not in message and all(t in message for t in ("Q4_K", "Q5_0", "Q6_K", "IQ4_XS", "BF16"))
    assert not (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(ValueError, match=r"^gguf: unsupported quant type IQ2_XXS in tensor blk\.0\.ffn_up\.weight; "):
        next(iter_gguf_weights(path, {"model_type": "llama"}))  # the loader names it too


def test_a_truncated_file_names_the_tensor_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", random_blocks(Q.Q8_0, 4, 64, np.random.default_rng(0)), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 64)  # past the padding after the data
    with pytest.raises(ValueError, match=r"^gguf: tensor blk\.0\.ffn_up\.weight runs past the end of the file"):
        next(iter_gguf_weights(path, {"model_type": "llama"}))
