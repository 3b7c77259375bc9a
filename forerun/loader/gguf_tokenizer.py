"""Build a `tokenizers` tokenizer from the vocabulary stored in a GGUF file.

Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`) are built here; SentencePiece ones
(`llama`) in `forerun.loader.gguf_spm`.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

from forerun.byte_alphabet import byte_level_alphabet
from forerun.loader.gguf_spm import build_spm_tokenizer
from forerun.loader.gguf_vocab import CONTROL, USER_DEFINED, GgufVocab

logger = logging.getLogger(__name__)

# Split patterns for the pre-tokenizer names llama.cpp writes to `tokenizer.ggml.pre`.
# The tiktoken-style pattern (Llama 3 and friends): up to three digits per piece.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: the same, but each digit is its own piece.
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
_LLAMA3_NAMES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"})
_QWEN2_NAMES = frozenset({"qwen2", "deepseek-r1-qwen"})
# StarCoder-lineage vocabularies (SmolLM, SmolLM2) split every digit, then apply GPT-2's regex.
_DIGIT_SPLIT_NAMES = frozenset({"smollm", "starcoder", "refact"})
_GPT2_NAMES = frozenset({"gpt2", "default"})


def _byte_level_spelling(token: str, alphabet: dict[int, str], letters: frozenset[str]) -> str:
    # Most GGUF files store tokens already spelled byte-level; a few store raw text (e.g. spaces).
    if set(token) <= letters:
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    if pre in _DIGIT_SPLIT_NAMES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), None
    for names, pattern in ((_LLAMA3_NAMES, _LLAMA3_PATTERN), (_QWEN2_NAMES, _QWEN2_PATTERN)):
        if pre in names:
            split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            # Qwen2's reference tokenizer normalizes to NFC before splitting.
            return pre_tokenizers.Sequence([split, byte_level]), normalizers.NFC() if names is _QWEN2_NAMES else None
    if pre not in _GPT2_NAMES:
        logger.warning("gguf: unknown tokenizer.ggml.pre %r; using GPT-2's split pattern", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """A `Tokenizer` equivalent to the one the GGUF file was made from (byte-level BPE or SentencePiece).

    Control tokens become special added tokens (never split, skipped by `skip_special_tokens`);
    user-defined tokens become plain added tokens.
    """
    if vocab.model == "llama":
        return build_spm_tokenizer(vocab)
    alphabet = byte_level_alphabet()
    letters = frozenset(alphabet.values())
    spelled = [
        tok if kind in (CONTROL, USER_DEFINED) else _byte_level_spelling(tok, alphabet, letters)
        for tok, kind in zip(vocab.tokens, vocab.token_types, strict=True)
    ]
    ids = {tok: i for i, tok in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre, norm = _pre_tokenizer(vocab.pre)
    tokenizer.pre_tokenizer = pre
    if norm is not None:
        tokenizer.normalizer = norm
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tok, special=kind == CONTROL, normalized=False)
        for tok, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind in (CONTROL, USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    if vocab.add_bos and vocab.bos_id is not None:
        bos = vocab.tokens[vocab.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tokenizer_config(vocab: GgufVocab, chat_template: str | None, max_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` content matching `build_tokenizer(vocab)`."""

    def name(token_id: int | None) -> str | None:
        return vocab.tokens[token_id] if token_id is not None and 0 <= token_id < len(vocab.tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos,
        # Only the SentencePiece builder appends EOS; say so only where the tokenizer does it.
        "add_eos_token": vocab.add_eos and vocab.model == "llama",
        "bos_token": name(vocab.bos_id),
        "eos_token": name(vocab.eos_id),
        "unk_token": name(vocab.unk_id),
        "pad_token": name(vocab.pad_id),
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template:
        config["chat_template"] = chat_template
    return config
