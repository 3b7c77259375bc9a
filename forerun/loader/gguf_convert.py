"""Convert a GGUF file (Llama, Qwen2, Qwen3) into a float32 Hugging Face model folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from safetensors.numpy import save_file
from tqdm import tqdm

from forerun.kernels.compact_weights import FORMATS
from forerun.loader.gguf_blocks import save_gguf_blocks
from forerun.loader.gguf_tensors import check_tensor_type, dequantize_tensor, hf_tensor_name, unpermute_rotary_rows
from forerun.loader.gguf_tokenizer import build_tokenizer, tokenizer_config
from forerun.loader.gguf_vocab import vocab_from_metadata

logger = logging.getLogger(__name__)

# architecture -> (HF class, model_type). Only llama's q/k rows are permuted by llama.cpp.
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value fields of a GGUF file as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _field(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    if key in meta:
        return meta[key]
    if default is None:
        raise ValueError(f"gguf: metadata field {key} is missing")
    return default


def _scalar_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = _field(meta, key, default)
    if isinstance(value, list):
        # Some files give a per-layer list (e.g. varying KV heads); the Llama family has one value.
        raise ValueError(f"gguf: metadata field {key} varies per layer, which Llama-family models do not support")
    return int(value)


def build_config(meta: dict[str, Any], vocab_rows: int, tied: bool) -> dict[str, Any]:
    """The Hugging Face `config.json` content for the model this metadata describes."""
    arch = str(_field(meta, "general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ValueError(f"gguf: general.architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    hidden = _scalar_int(meta, f"{arch}.embedding_length")
    heads = _scalar_int(meta, f"{arch}.attention.head_count")
    head_dim = _scalar_int(meta, f"{arch}.attention.key_length", hidden // heads)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"gguf: {arch}.rope.scaling.type {scaling!r} is not supported")
    hf_class, model_type = _ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _scalar_int(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _scalar_int(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar_int(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _scalar_int(meta, f"{arch}.context_length"),
        "vocab_size": vocab_rows,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "qwen3":
        config.update(attention_bias=False)
    else:
        config.update(use_sliding_window=False)
    return config


def _convert_tensors(reader: GGUFReader, config: dict[str, Any], show_progress: bool
                     ) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, torch.Tensor, int]]]:
    """fp32 tensors by HF name, and the quantized blocks of every block-quantized matrix
    (format, uint8 rows in the same row order, row length), which small-batch matmuls read.

    Only the formats compact_weights' kernels read (Q8_0, Q4_0, Q4_1) keep their blocks; the others
    (k-quants, Q5_0/Q5_1, IQ4) load as dense fp32 until kernels read their blocks too."""
    permute = config["model_type"] == "llama"
    out: dict[str, np.ndarray] = {}
    blocks: dict[str, tuple[str, torch.Tensor, int]] = {}
    for tensor in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not show_progress):
        name = hf_tensor_name(tensor.name)
        weight = dequantize_tensor(tensor)
        raw = np.asarray(tensor.data)
        quantized = tensor.tensor_type.name in FORMATS and weight.ndim == 2 and raw.ndim == 2
        heads = None
        if permute and name.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif permute and name.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        if heads is not None:
            weight = unpermute_rotary_rows(weight, heads)
            raw = unpermute_rotary_rows(raw, heads) if quantized else raw
        out[name] = weight
        if quantized:
            blocks[name] = (tensor.tensor_type.name, torch.from_numpy(np.array(raw, copy=True)), weight.shape[1])
    return out, blocks


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, show_progress: bool) -> None:
    """Write config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json and
    generation_config.json for the GGUF file into `out_dir` (created if missing), plus the
    block-quantized matrices' own blocks (forerun.loader.gguf_blocks.BLOCKS_FILE).

    Everything is validated (architecture, tensor names and types, tokenizer) before the slow
    de-quantization starts, so bad input fails fast with a ValueError naming the field.
    """
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        hf_tensor_name(tensor.name)
        check_tensor_type(tensor)
    if "token_embd.weight" not in names:
        raise ValueError("gguf: tensor token_embd.weight is missing")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = build_config(meta, vocab_rows=int(embed.shape[-1]), tied="output.weight" not in names)
    vocab = vocab_from_metadata(meta)
    tokenizer = build_tokenizer(vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, blocks = _convert_tensors(reader, config, show_progress)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if blocks:
        save_gguf_blocks(out_dir, blocks)
    _write_json(out_dir / "config.json", config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json",
                tokenizer_config(vocab, meta.get("tokenizer.chat_template"), config["max_position_embeddings"]))
    generation = {"bos_token_id": vocab.bos_id, "eos_token_id": vocab.eos_id, "pad_token_id": vocab.pad_id}
    _write_json(out_dir / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
    logger.info("converted %s into %s", gguf_path, out_dir)
