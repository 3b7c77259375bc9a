"""The ids that end generation for a GGUF file: its EOS id, the end-of-turn and end-of-message ids its
metadata names (tokenizer.ggml.eot_token_id, eom_token_id), and the end-of-turn control tokens of the
families forerun loads (a Llama 3 file whose EOS is <|end_of_text|> ends its chat turns on <|eot_id|>).
llama.cpp stops on all of them; a user of the same file expects forerun to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_factory import write_model_gguf
from transformers import LlamaConfig, LlamaForCausalLM

from forerun import LLM, SamplingParams
from forerun.loader.gguf_convert import describe_gguf, generation_config
from forerun.loader.gguf_vocab import vocab_from_metadata


def _meta(**ids: int) -> dict:
    tokens = ["a", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "x"]
    types = [1, 3, 3, 3, 1, 1]  # "<|im_end|>" here is an ordinary token, not a control one
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["a x"], **{f"tokenizer.ggml.{k}_token_id": v for k, v in ids.items()}}


def test_stop_ids_are_eos_the_named_ids_and_end_of_turn_control_tokens() -> None:
    assert vocab_from_metadata(_meta(eos=1)).stop_ids == (1, 2, 3)
    assert vocab_from_metadata(_meta(eos=1, eot=5)).stop_ids == (1, 2, 3, 5)  # named in the metadata: kept
    assert vocab_from_metadata(_meta()).stop_ids == (1, 2, 3)  # no EOS id at all
    with pytest.raises(ValueError, match="tokenizer.ggml.eom_token_id"):
        vocab_from_metadata(_meta(eos=1, eom=6))  # past the vocabulary


def test_generation_config_names_every_stop_even_a_single_one_that_is_not_eos() -> None:
    assert generation_config(vocab_from_metadata(_meta(eos=1)))["eos_token_id"] == [1, 2, 3]
    assert generation_config(vocab_from_metadata(_meta(eos=5, eot=5)))["eos_token_id"] == [1, 2, 3, 5]
    one = _meta()  # no EOS id, and <|eot_id|> the one control token that ends generation
    one["tokenizer.ggml.token_type"] = [1, 1, 3, 1, 1, 1]
    assert vocab_from_metadata(one).stop_ids == (2,)
    assert generation_config(vocab_from_metadata(one))["eos_token_id"] == 2


def _tiny() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=266, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("eot", [None, 1])
def test_generation_stops_on_the_files_end_of_turn_id(tmp_path: Path, eot: int | None) -> None:
    # The tiny vocabulary: 0 <|endoftext|> and 2 <|im_end|> are control tokens that end generation, 2 is
    # EOS; 1 <|im_start|> ends it only where the file names it its end-of-turn id.
    path = tmp_path / "m.gguf"
    write_model_gguf(path, _tiny(), "llama", fields=None if eot is None else {"tokenizer.ggml.eot_token_id": eot})
    describe_gguf(path, tmp_path / "described")
    stops = json.loads((tmp_path / "described" / "generation_config.json").read_text())["eos_token_id"]
    assert stops == ([0, 2] if eot is None else [0, 1, 2])
    params = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={1: 100.0})  # always token 1
    with LLM(model=str(path), dtype="float32", show_progress=False) as llm:
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    if eot is None:
        assert (out.token_ids, out.finish_reason) == ([1, 1, 1, 1], "length")
    else:
        assert (list(out.token_ids), out.finish_reason) == ([1], "stop")
