"""Build a `tokenizers` tokenizer from the vocabulary stored in a GGUF file.

Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`) are built here; SentencePiece ones
(`llama`) in `forerun.loader.gguf_spm`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

from forerun.byte_alphabet import byte_level_alphabet
from forerun.loader.gguf_spm import build_spm_tokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType): 3 is CONTROL, 4 is USER_DEFINED.
_CONTROL = 3
_USER_DEFINED = 4

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
_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer fields of a GGUF file; tokens, token_types and scores are index-aligned, and
    every special id is None or a valid index into tokens.

    `merges` is filled for BPE (`gpt2`) files only; SentencePiece (`llama`) files give `scores`
    instead, from which `gguf_spm` derives the merges.
    """

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    scores: list[float] = field(default_factory=list)
    add_eos: bool = False
    add_space_prefix: bool = False


def _token_id(meta: dict[str, Any], key: str, count: int, default: int | None) -> int | None:
    value = meta.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise ValueError(f"gguf: {key} is {value!r}, not a token id below the vocabulary size {count}")
    return value


def _list_field(meta: dict[str, Any], key: str, count: int) -> list[Any] | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count:
        size = len(value) if isinstance(value, list) else type(value).__name__
        raise ValueError(f"gguf: {key} has {size} entries, but tokenizer.ggml.tokens has {count}")
    return value


def vocab_from_metadata(meta: dict[str, Any]) -> GgufVocab:
    """Collect the tokenizer fields from decoded GGUF metadata; ValueError when one is missing."""
    model = meta.get("tokenizer.ggml.model")
    if model not in _MODELS:
        raise ValueError(f"gguf: tokenizer.ggml.model {model!r} is not supported; supported: {list(_MODELS)} "
                         "(byte-level BPE, SentencePiece)")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("gguf: tokenizer.ggml.tokens is missing")
    count = len(tokens)
    types = _list_field(meta, "tokenizer.ggml.token_type", count) or [1] * count
    spm = model == "llama"
    merges: list[str] = []
    scores: list[float] = []
    if spm:
        # The scores rank the merges; without them the vocabulary cannot be applied.
        found = _list_field(meta, "tokenizer.ggml.scores", count)
        if found is None:
            raise ValueError("gguf: tokenizer.ggml.scores is missing (a SentencePiece vocabulary needs it)")
        scores = [float(x) for x in found]
    else:
        merges = list(meta.get("tokenizer.ggml.merges") or [])
        if not merges:
            raise ValueError("gguf: tokenizer.ggml.tokens and tokenizer.ggml.merges must both be present")
    # llama.cpp's defaults when a key is absent: SentencePiece files mean <unk>=0, <s>=1, </s>=2,
    # a BOS in front and a space prefix; BPE files mean none of these.
    return GgufVocab(
        model=model, pre=str(meta.get("tokenizer.ggml.pre", "default")), tokens=tokens,
        token_types=[int(t) for t in types], merges=merges,
        bos_id=_token_id(meta, "tokenizer.ggml.bos_token_id", count, 1 if spm else None),
        eos_id=_token_id(meta, "tokenizer.ggml.eos_token_id", count, 2 if spm else None),
        unk_id=_token_id(meta, "tokenizer.ggml.unknown_token_id", count, 0 if spm else None),
        pad_id=_token_id(meta, "tokenizer.ggml.padding_token_id", count, None),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
        scores=scores,
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", spm)),
    )


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
        tok if kind in (_CONTROL, _USER_DEFINED) else _byte_level_spelling(tok, alphabet, letters)
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
        AddedToken(tok, special=kind == _CONTROL, normalized=False)
        for tok, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind in (_CONTROL, _USER_DEFINED)
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
