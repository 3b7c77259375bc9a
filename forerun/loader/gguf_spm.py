"""Build a `tokenizers` tokenizer for a GGUF SentencePiece vocabulary (`tokenizer.ggml.model = llama`).

Llama 2, Mistral and TinyLlama ship a SentencePiece *BPE* model. Its encoder (and llama.cpp's SPM
tokenizer, which reimplements it) starts from the text's characters and keeps merging the adjacent
pair whose concatenation is a vocabulary piece with the highest score; a character that is no piece
becomes its UTF-8 bytes as `<0xNN>` tokens. A GGUF stores the pieces and their scores but no merge
list, so the merge list is derived here: every split of a piece into two pieces is a merge, ranked by
the piece's score. A `tokenizers` BPE model with that list and byte fallback then makes the same
choices, because at each step it applies the best-ranked adjacent pair, which is the best-scored one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from forerun.loader.gguf_vocab import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, GgufVocab

logger = logging.getLogger(__name__)

SPACE_MARK = "\u2581"  # SentencePiece writes a space as this mark ("lower one eighth block")

# Pieces the encoder may merge into. SentencePiece never merges into control, unknown or byte
# pieces, and splits an unused piece back into its parts, so none of those get a merge.
_MERGEABLE = frozenset({NORMAL, USER_DEFINED})


def spm_merges(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a mergeable piece into two pieces, best-scored piece first.

    Equal scores keep the vocabulary order, where SentencePiece would take the leftmost pair; the two
    differ only for pieces that share a score (a trained BPE vocabulary gives each its own) or for
    one piece that can form at two overlapping places ("aaa" from a|aa and aa|a), both rare.
    """
    known = set(tokens)
    ranked: list[tuple[float, int, str, str]] = []
    for index, (piece, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind not in _MERGEABLE or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                ranked.append((-float(scores[index]), index, left, right))
    ranked.sort(key=lambda entry: (entry[0], entry[1]))
    return [(left, right) for _, _, left, right in ranked]


def _post_processor(vocab: GgufVocab) -> processors.PostProcessor | None:
    def special(token_id: int | None, field: str) -> tuple[str, int]:
        if token_id is None:
            raise ValueError(f"gguf: {field} is set but the matching token id is missing")
        return vocab.tokens[token_id], token_id

    head = [special(vocab.bos_id, "tokenizer.ggml.add_bos_token")] if vocab.add_bos else []
    tail = [special(vocab.eos_id, "tokenizer.ggml.add_eos_token")] if vocab.add_eos else []
    if not head and not tail:
        return None

    def wrap(body: str, type_id: int) -> str:
        return " ".join([*(f"{t}:{type_id}" for t, _ in head), f"{body}:{type_id}",
                         *(f"{t}:{type_id}" for t, _ in tail)])

    return processors.TemplateProcessing(single=wrap("$A", 0), pair=f"{wrap('$A', 0)} {wrap('$B', 1)}",
                                         special_tokens=sorted(set(head + tail), key=lambda pair: pair[1]))


def build_spm_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """A `Tokenizer` that encodes and decodes like the SentencePiece model the GGUF was made from.

    Invariants: token ids equal GGUF ids; control and unknown tokens are special added tokens (never
    split, dropped by `skip_special_tokens`), user-defined tokens plain added tokens; with
    `add_space_prefix` each stretch of text between added tokens gets one leading `▁`, as
    llama.cpp does, and decoding drops the first leading space again.
    """
    if len(vocab.scores) != len(vocab.tokens):
        raise ValueError(f"gguf: tokenizer.ggml.scores has {len(vocab.scores)} entries, "
                         f"tokenizer.ggml.tokens {len(vocab.tokens)}")
    ids: dict[str, int] = {}
    for index, token in enumerate(vocab.tokens):
        if ids.setdefault(token, index) != index:
            logger.warning("gguf: token %r appears twice in tokenizer.ggml.tokens (ids %d and %d); "
                           "text maps to the first", token, ids[token], index)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    missing_bytes = [b for b in range(256) if f"<0x{b:02X}>" not in ids]
    if missing_bytes:
        # Then a character outside the vocabulary becomes the unknown token, as in SentencePiece.
        logger.info("gguf: %d of the 256 byte tokens are missing; byte fallback is partial", len(missing_bytes))
    model = models.BPE(vocab=ids, merges=spm_merges(vocab.tokens, vocab.scores, vocab.token_types),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    # No pre-tokenizer: SentencePiece merges across the whole text, spaces included. A normalizer
    # (not a Metaspace pre-tokenizer) adds the prefix, because it runs on every stretch between added
    # tokens: llama.cpp puts a space in front of the text that follows a special token too.
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPACE_MARK)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE_MARK))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode_steps: list[decoders.Decoder] = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(),
                                            decoders.Fuse()]
    if vocab.add_space_prefix:
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    added = [
        AddedToken(token, special=kind != USER_DEFINED, normalized=False)
        for token, kind in zip(vocab.tokens, vocab.token_types, strict=True)
        if kind in (CONTROL, UNKNOWN, USER_DEFINED) and token
    ]
    tokenizer.add_tokens(added)
    post = _post_processor(vocab)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer
