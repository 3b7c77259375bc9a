"""Shared fixtures: the real default model folder and tiny random models that load in milliseconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once into the user's forerun cache."""
    from forerun.model.model_source import resolve_model
    return resolve_model(None, show_progress=False)


def save_tiny_model(out: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0, stored_dtype: str = "float32",
                    **overrides) -> Path:
    """A random model of `arch` with SmolLM2's tokenizer, saved as a Hugging Face folder with its
    weights in `stored_dtype` (real checkpoints are mostly bf16)."""
    import torch
    import transformers as tf

    kwargs = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, torch_dtype="float32",
                  # A wide init makes greedy outputs vary from token to token, so equality tests mean something.
                  initializer_range=0.3)
    kwargs.update(overrides)
    config_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
                  "mistral": tf.MistralConfig}[arch]
    model_cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
                 "mistral": tf.MistralForCausalLM}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval().to(getattr(torch, stored_dtype))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)
