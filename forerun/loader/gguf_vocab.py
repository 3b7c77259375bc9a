"""The tokenizer fields of a GGUF file, read and checked once: what both the byte-level BPE builder
(`gguf_tokenizer`) and the SentencePiece one (`gguf_spm`) are given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forerun.loader.gguf_pretokenizers import adds_bos_by_default

# The values of `tokenizer.ggml.model` forerun builds tokenizers for.
_MODELS = ("gpt2", "llama")
# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
# Control tokens that end a turn or a text in the chat formats of the families forerun loads (Llama 3;
# ChatML: Qwen, SmolLM2). A file names one EOS id, often the end of a text where a chat turn ends on
# another (a Llama 3 file with EOS <|end_of_text|> ends its turns on <|eot_id|>); llama.cpp stops on
# all of them, and so does forerun.
_END_OF_GENERATION = frozenset({"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>"})


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
    # The ids that end generation: EOS, the file's end-of-turn and end-of-message ids
    # (tokenizer.ggml.eot_token_id, eom_token_id), and the control tokens of _END_OF_GENERATION.
    stop_ids: tuple[int, ...] = ()


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
    eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", count, 2 if spm else None)
    named = (eos_id, *(_token_id(meta, f"tokenizer.ggml.{k}_token_id", count, None) for k in ("eot", "eom")))
    stops = {i for i in named if i is not None}
    stops.update(i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == CONTROL
                 and tok in _END_OF_GENERATION)
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    return GgufVocab(
        model=model, pre=pre, tokens=tokens,
        token_types=[int(t) for t in types], merges=merges,
        bos_id=_token_id(meta, "tokenizer.ggml.bos_token_id", count, 1 if spm else None),
        eos_id=eos_id,
        unk_id=_token_id(meta, "tokenizer.ggml.unknown_token_id", count, 0 if spm else None),
        pad_id=_token_id(meta, "tokenizer.ggml.padding_token_id", count, None),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm or adds_bos_by_default(pre))),
        scores=scores,
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", spm)),
        stop_ids=tuple(sorted(stops)),
    )
