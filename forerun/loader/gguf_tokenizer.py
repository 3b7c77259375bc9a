"""Build a `tokenizers` tokenizer from the vocabulary stored in a GGUF file.

Byte-level BPE vocabularies (`tokenizer.ggml.model = gpt2`) are built here; SentencePiece ones
(`llama`) in `forerun.loader.gguf_spm`.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, processors

from forerun.byte_alphabet import byte_level_alphabet
from forerun.loader.gguf_pretokenizers import build_pre_tokenizer, pre_tokenizer_family
from forerun.loader.gguf_spm import build_spm_tokenizer
from forerun.loader.gguf_vocab import CONTROL, USER_DEFINED, GgufVocab


def _byte_level_spelling(token: str, alphabet: dict[int, str], letters: frozenset[str]) -> str:
    # Most GGUF files store tokens already spelled byte-level; a few store raw text (e.g. spaces).
    if set(token) <= letters:
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


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
    family = pre_tokenizer_family(vocab.pre)
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=pairs, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=family.ignore_merges))
    pre, norm = build_pre_tokenizer(family)
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
