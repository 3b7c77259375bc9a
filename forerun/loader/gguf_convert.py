"""A GGUF file (Llama, Qwen2, Qwen3) as a model folder: its config and tokenizer beside a pointer to the
file (what forerun loads), or a full float32 Hugging Face export (a reference for other tools)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from safetensors.numpy import save_file
from tqdm import tqdm

from forerun.loader.gguf_tensors import (ROPE_FREQS, check_tensor_type, dequantize_tensor, hf_tensor_name,
                                        rope_freq_factors, unpermute_rotary_rows)
from forerun.loader.gguf_pointer import write_pointer
from forerun.loader.gguf_rope import rope_scaling
from forerun.loader.gguf_weights import rotary_heads
from forerun.loader.gguf_tokenizer import build_tokenizer, tokenizer_config
from forerun.loader.gguf_vocab import GgufVocab, vocab_from_metadata

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


def build_config(meta: dict[str, Any], vocab_rows: int, tied: bool,
                 freq_factors: list[float] | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` content for the model this metadata describes; `freq_factors`:
    the file's rope_freqs.weight (Llama 3.1-style scaling), kept as forerun's `freq_factors` rope type,
    where the metadata's rope scaling is read too (forerun.loader.gguf_rope)."""
    arch = str(_field(meta, "general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ValueError(f"gguf: general.architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    hidden = _scalar_int(meta, f"{arch}.embedding_length")
    heads = _scalar_int(meta, f"{arch}.attention.head_count")
    head_dim = _scalar_int(meta, f"{arch}.attention.key_length", hidden // heads)
    # A rotary embedding over part of each head (or values of another size) is not what forerun's layers
    # compute: refused, so that such a file never runs as if it were a plain Llama.
    for key, want in ((f"{arch}.rope.dimension_count", "rotary dimensions"),
                      (f"{arch}.attention.value_length", "value dimensions")):
        size = _scalar_int(meta, key, head_dim)  # absent: the head size, as llama.cpp reads it
        if size != head_dim:
            raise ValueError(f"gguf: {key} is {size}; forerun needs {want} equal to the head size {head_dim}")
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
    scaling = rope_scaling(meta, arch, head_dim, config["max_position_embeddings"], freq_factors)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "qwen3":
        config.update(attention_bias=False)
    else:
        config.update(use_sliding_window=False)
    return config


def _fp32_tensors(reader: GGUFReader, config: dict[str, Any], show_progress: bool) -> dict[str, np.ndarray]:
    """Every tensor de-quantized to float32, by Hugging Face name, q/k rows in Hugging Face's order."""
    out: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="de-quantizing GGUF", unit="tensor", disable=not show_progress):
        if tensor.name == ROPE_FREQS:  # in the config (build_config)
            continue
        name = hf_tensor_name(tensor.name)
        weight = dequantize_tensor(tensor)
        heads = rotary_heads(name, config)
        out[name] = unpermute_rotary_rows(weight, heads) if heads is not None else weight
    return out


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _read_checked(gguf_path: Path) -> tuple[GGUFReader, dict[str, Any], dict[str, Any]]:
    """The reader, metadata and Hugging Face config of a GGUF file whose tensors all have a name and a
    type forerun reads; ValueError naming the field otherwise, before any weight's data is read."""
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if meta.get(f"{arch}.expert_count"):  # Mixtral-style files say "llama"; their expert tensors have no name here
        raise ValueError(f"gguf: {arch}.expert_count is {meta[f'{arch}.expert_count']}: mixture-of-experts "
                         "models are not supported")
    by_name = {t.name: t for t in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name != ROPE_FREQS:
            hf_tensor_name(tensor.name)
        check_tensor_type(tensor)
    if "token_embd.weight" not in by_name:
        raise ValueError("gguf: tensor token_embd.weight is missing")
    factors = rope_freq_factors(by_name[ROPE_FREQS]) if ROPE_FREQS in by_name else None
    config = build_config(meta, vocab_rows=int(by_name["token_embd.weight"].shape[-1]),
                          tied="output.weight" not in by_name, freq_factors=factors)
    return reader, meta, config


def _write_description(meta: dict[str, Any], config: dict[str, Any], out_dir: Path) -> None:
    """config.json, tokenizer.json, tokenizer_config.json and generation_config.json into `out_dir`."""
    vocab = vocab_from_metadata(meta)
    tokenizer = build_tokenizer(vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json",
                tokenizer_config(vocab, meta.get("tokenizer.chat_template"), config["max_position_embeddings"]))
    _write_json(out_dir / "generation_config.json", generation_config(vocab))


def generation_config(vocab: GgufVocab) -> dict[str, Any]:
    """generation_config.json's content: BOS, pad, and every id that ends generation (one id, or a list)."""
    ids = vocab.stop_ids
    stops: list[int] | int | None = list(ids) if len(ids) > 1 else ids[0] if ids else None
    generation = {"bos_token_id": vocab.bos_id, "eos_token_id": stops, "pad_token_id": vocab.pad_id}
    return {k: v for k, v in generation.items() if v is not None}


def describe_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Make `out_dir` a model folder for the GGUF file: its config, its tokenizer and a pointer to the
    file (forerun.loader.gguf_weights), whose tensors are read as stored at every load. No weight is
    converted or copied. Everything is validated first (architecture, tensor names and types,
    tokenizer), so bad input fails fast with a ValueError naming the field."""
    reader, meta, config = _read_checked(gguf_path)
    del reader
    _write_description(meta, config, out_dir)
    write_pointer(out_dir, gguf_path)
    logger.info("described %s in %s", gguf_path, out_dir)


def export_hf_folder(gguf_path: Path, out_dir: Path, show_progress: bool = False) -> None:
    """Write the GGUF file as a Hugging Face folder with float32 safetensors (de-quantized exactly as
    gguf's reference does): for other tools, such as transformers as a reference in tests. A file's
    rope_freqs.weight stays in the config as forerun's `freq_factors` rope type, which transformers
    refuses: it cannot name the llama3 parameters the factors came from."""
    reader, meta, config = _read_checked(gguf_path)
    _write_description(meta, config, out_dir)
    save_file(_fp32_tensors(reader, config, show_progress), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
