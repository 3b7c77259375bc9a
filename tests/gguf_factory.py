"""Test helpers: write tiny GGUF files from tiny transformers models (the way llama.cpp lays them out)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

Q = gguf.GGMLQuantizationType
# Byte offsets of the fp16 fields (d, and dmin or m) inside one block, from ggml's block structs.
FP16_FIELDS: dict[gguf.GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}
# Float types: (unsigned view, exponent mask); a value is finite unless all its exponent bits are set.
_FLOAT_BITS = {Q.F32: (np.uint32, 0x7F800000), Q.F16: (np.uint16, 0x7C00), Q.BF16: (np.uint16, 0x7F80)}

_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def finite_bits(rng: np.random.Generator, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Random bit patterns of the float type `qtype` (F32, F16, BF16), every one finite: zeros,
    subnormals and the largest values included, never inf or NaN."""
    view, exponent = _FLOAT_BITS[qtype]
    bits = rng.integers(0, np.iinfo(view).max, size=shape, dtype=view, endpoint=True)
    bits[(bits & exponent) == exponent] &= view(~exponent & np.iinfo(view).max)  # clear the exponent
    return bits


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
                  std: float | None = None) -> np.ndarray:
    """uint8 [rows, bytes per row] of random valid `qtype` data: random codes, finite fp16 scales.

    With `std` None the scales are any finite fp16 bit patterns (for bit-exact format checks);
    otherwise they are rescaled so the de-quantized values have about that standard deviation
    (weights for a model that should compute something sensible).
    """
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in _FLOAT_BITS:
        if std is None:
            return finite_bits(rng, (rows, cols), qtype).view(np.uint8)
        values = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(values, qtype)).view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        scales = finite_bits(rng, blocks.shape[:2], Q.F16) if std is None else \
            (rng.uniform(0.5, 1.5, blocks.shape[:2]) * rng.choice([-1.0, 1.0], blocks.shape[:2])).astype(np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if std is not None:
        # Every format is linear in its fp16 fields, so one common factor sets the spread.
        factor = std / float(gguf.quants.dequantize(blocks.reshape(rows, -1), qtype).std())
        for at in FP16_FIELDS[qtype]:
            field = blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32) * factor
            blocks[..., at:at + 2] = field.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def byte_tokens() -> list[str]:
    """The 256 single-byte tokens in GPT-2's printable spelling, in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Tokens (specials, bytes, merge results) and their llama.cpp token types."""
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + byte_tokens() + merged
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


@dataclass(frozen=True)
class SpmVocab:
    """A SentencePiece vocabulary as llama.cpp writes it (`tokenizer.ggml.model = llama`);
    tokens, scores and types are index-aligned."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 0
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = True
    chat_template: str | None = None

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(self.tokens)
        w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        w.add_bos_token_id(self.bos_id)
        w.add_eos_token_id(self.eos_id)
        w.add_unk_token_id(self.unk_id)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(self.add_eos)
        w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row interleave (HF rotate-half order -> neighbour pairs), written from its definition."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name llama.cpp gives a Hugging Face Llama-family tensor."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    return f"blk.{parts[2]}.{_BLOCK[parts[3]]}"


def write_model_gguf(path: Path, model: torch.nn.Module, arch: str,
                     qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                     spm: SpmVocab | None = None,
                     qtypes: Mapping[str, gguf.GGMLQuantizationType] | None = None, seed: int = 0,
                     rope_freqs: np.ndarray | None = None,
                     fields: Mapping[str, int | float | str] | None = None) -> None:
    """Write `model` (a tiny transformers causal LM) and the tiny vocabulary to a GGUF file
    (or, given `spm`, that SentencePiece vocabulary instead), with `rope_freqs` as the F32 tensor
    rope_freqs.weight where given (llama.cpp's form of Llama 3.1-style rope scaling), and `fields` as
    further metadata fields (key: value; an int as uint32, a float as float32, a str as a string).

    `qtypes` overrides `qtype` per GGUF tensor name (a llama.cpp-style mix). Types the gguf package
    cannot quantize (the k-quants, IQ4) get random valid blocks of the weight's spread (from `seed`)
    instead of the weight itself: the file, not the model, is then the reference.
    """
    rng = np.random.default_rng(seed)
    cfg = model.config
    tokens, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if spm is not None:
        spm.write(w)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (fields or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    tied = cfg.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = llama_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = llama_permute(data, cfg.num_key_value_heads)
        kind = (qtypes or {}).get(gguf_name(name), qtype) if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        try:
            raw = gguf.quants.quantize(data, kind)
        except NotImplementedError:
            raw = random_blocks(kind, data.shape[0], data.shape[1], rng, std=float(data.std()))
        w.add_tensor(gguf_name(name), raw, raw_dtype=kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LAYER_KEYS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_mixed_llama_gguf(path: Path, layer_types: tuple[gguf.GGMLQuantizationType, ...], seed: int,
                           max_positions: int = 256) -> Path:
    """A random 2-layer Llama (hidden 256, MLP 512, 4 heads / 2 KV heads of 64, tied embeddings in
    Q8_0) with the tiny vocabulary, its layers' matrices in `layer_types` (one per LAYER_KEYS entry,
    as a llama.cpp K-quant mix holds them), written to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=len(tiny_vocab()[0]), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=max_positions, rms_norm_eps=1e-5, rope_theta=50000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    mix = {"token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    for i in range(2):
        mix.update({f"blk.{i}.{key}.weight": t for key, t in zip(LAYER_KEYS, layer_types, strict=True)})
    write_model_gguf(path, LlamaForCausalLM(config).eval(), "llama", qtypes=mix, seed=seed)
    return path
