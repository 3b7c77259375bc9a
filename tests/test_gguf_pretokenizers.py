"""The pre-tokenizers of byte-level BPE GGUF files, by `tokenizer.ggml.pre`.

The reference is transformers' own GGUF tokenizer converter (the families it knows: Llama 3, Tekken,
Qwen2), on SmolLM2's vocabulary cut to its first 6,000 tokens (a complete BPE: the merges that stay
make only kept tokens) and given each name. The two flags llama.cpp's loader sets per family (a piece
that is a vocabulary entry skips the merges; a BOS where the file does not say) are checked on
vocabularies built for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
from test_gguf_convert import TRICKY
from transformers import AutoTokenizer

from forerun.byte_alphabet import byte_level_alphabet
from forerun.loader.gguf_convert import read_metadata
from forerun.loader.gguf_tokenizer import build_tokenizer
from forerun.loader.gguf_vocab import NORMAL, vocab_from_metadata
from forerun.loader.model_source import default_model_gguf

KEEP = 6000
TEXTS = [*TRICKY, "HelloWorld camelCaseString XMLHttpRequest iPhone", "a/b/c // path/to/file.py\n",
         "ÉCOLE École naïveTÉST", "1234567 12 x1y2", "don't DON'T we've"]


@pytest.fixture(scope="module")
def small_vocab() -> tuple[dict[str, Any], dict[str, gguf.GGUFValueType]]:
    """SmolLM2's tokenizer fields, its vocabulary cut to KEEP tokens, and each field's GGUF type."""
    reader = gguf.GGUFReader(default_model_gguf())
    meta = {k: v for k, v in read_metadata(reader).items() if k.startswith("tokenizer.")}
    kept = set(meta["tokenizer.ggml.tokens"][:KEEP])
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:KEEP]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:KEEP]
    meta["tokenizer.ggml.merges"] = [m for m in meta["tokenizer.ggml.merges"]
                                     if m.replace(" ", "", 1) in kept and set(m.split(" ", 1)) <= kept]
    assert len(meta["tokenizer.ggml.merges"]) > 5000
    return meta, {k: reader.fields[k].types[0] for k in meta}


def _write(path: Path, meta: dict[str, Any], types: dict[str, gguf.GGUFValueType]) -> Path:
    """A GGUF holding only `meta` (what a tokenizer is built from)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if types[key] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, types[key])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["llama-bpe", "tekken", "qwen2", "smaug-bpe"])
def test_pieces_match_transformers_gguf_converter(tmp_path: Path, small_vocab, pre: str) -> None:
    meta, types = small_vocab
    meta = {**meta, "tokenizer.ggml.pre": pre}
    path = _write(tmp_path / "vocab.gguf", meta, types)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = build_tokenizer(vocab_from_metadata(meta))
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == reference(text, add_special_tokens=False)["input_ids"], text


def test_tekken_and_deepseek_coder_pieces() -> None:
    """The pieces each pattern set cuts (from the patterns' definitions), which GPT-2's would not."""
    def pieces(pre: str, text: str) -> list[str]:
        tok = build_tokenizer(vocab_from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                                   "tokenizer.ggml.tokens": ["a", "aa"],
                                                   "tokenizer.ggml.token_type": [NORMAL, NORMAL],
                                                   "tokenizer.ggml.merges": ["a a"]}))
        mapped = {v: chr(k) for k, v in byte_level_alphabet().items()}
        return ["".join(mapped[c] for c in piece) for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]

    assert pieces("tekken", "HelloWorld it's 123 a/b") == ["Hello", "World", " it", "'s", " ", "1", "2", "3", " a",
                                                           "/b"]
    assert pieces("deepseek-coder", "def f(x):\n  return 42") == ["def", " f", "(", "x", "):", "\n", " ", " return",
                                                                  " ", "4", "2"]
    assert pieces("gpt2", "HelloWorld 123") == ["HelloWorld", " 123"]


def _merge_vocab(pre: str, **extra: Any) -> dict[str, Any]:
    """Bytes a, b, c, the merge a+b, and a token abc that no merge makes."""
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": ["<s>", "a", "b", "c",
            "ab", "abc"], "tokenizer.ggml.token_type": [3, *[NORMAL] * 5], "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": 0, **extra}


@pytest.mark.parametrize(("pre", "whole"), [("llama-bpe", True), ("tekken", True), ("smaug-bpe", False),
                                             ("qwen2", False), ("gpt2", False)])
def test_a_piece_that_is_a_token_skips_the_merges_where_llama_cpp_does(pre: str, whole: bool) -> None:
    tok = build_tokenizer(vocab_from_metadata(_merge_vocab(pre, **{"tokenizer.ggml.add_bos_token": False})))
    assert tok.encode("abc").tokens == (["abc"] if whole else ["ab", "c"])


@pytest.mark.parametrize(("pre", "field", "bos"), [
    ("llama-bpe", None, True), ("tekken", None, True), ("llama-bpe", False, False),
    ("qwen2", None, False), ("gpt2", None, False), ("gpt2", True, True)])
def test_bos_where_the_file_does_not_say_follows_llama_cpp(pre: str, field: bool | None, bos: bool) -> None:
    extra = {} if field is None else {"tokenizer.ggml.add_bos_token": field}
    vocab = vocab_from_metadata(_merge_vocab(pre, **extra))
    assert vocab.add_bos is bos
    assert build_tokenizer(vocab).encode("ab").ids == ([0, 4] if bos else [4])
