"""Test helpers: write tiny GGUF files from tiny transformers models (the way llama.cpp lays them out)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

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
                     qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> None:
    """Write `model` (a tiny transformers causal LM) and the tiny vocabulary to a GGUF file."""
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
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    tied = cfg.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = llama_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = llama_permute(data, cfg.num_key_value_heads)
        kind = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        w.add_tensor(gguf_name(name), gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
