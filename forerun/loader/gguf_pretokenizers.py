"""The pre-tokenizers of byte-level BPE GGUF files, by the name llama.cpp's converter writes to
`tokenizer.ggml.pre`: how text is cut into pieces before BPE, whether a piece that is itself a
vocabulary entry skips the merges, and whether a BOS is added where the file does not say.

Each family's split patterns are those of the tokenizer.json the files were converted from; the two
flags follow llama.cpp's loader (`tokenizer_ignore_merges`, `tokenizer_add_bos`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers

logger = logging.getLogger(__name__)

# The tiktoken-style pattern (Llama 3 and friends): up to three digits per piece.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Tekken (Mistral NeMo, Mistral Small): words cut at a lower-to-upper case change, no contractions,
# each digit its own piece, and a slash kept with the punctuation before it.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-Coder: line breaks, letters and punctuation (each with one leading space), CJK runs, one
# piece a digit; each pattern cuts the pieces the one before left.
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+")


@dataclass(frozen=True)
class PreTokenizerFamily:
    """`splits`: regexes applied in turn (each isolating its matches in the pieces of the one before);
    `digits`: every digit its own piece after them; `gpt2_split`: GPT-2's own pattern last (byte-level
    BPE's default); `nfc`: text normalized to NFC first; `ignore_merges`: a piece found whole in the
    vocabulary is that token; `add_bos`: a BOS in front unless tokenizer.ggml.add_bos_token says no."""

    splits: tuple[str, ...] = ()
    digits: bool = False
    gpt2_split: bool = False
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = PreTokenizerFamily(gpt2_split=True)
_FAMILIES: dict[str, PreTokenizerFamily] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"),
                    PreTokenizerFamily(splits=(_LLAMA3,), ignore_merges=True, add_bos=True)),
    **dict.fromkeys(("smaug-bpe", "dbrx"), PreTokenizerFamily(splits=(_LLAMA3,))),
    # Qwen2's reference tokenizer normalizes to NFC before splitting.
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"),
                    PreTokenizerFamily(splits=(_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}"),), nfc=True)),
    "tekken": PreTokenizerFamily(splits=(_TEKKEN,), ignore_merges=True, add_bos=True),
    "deepseek-coder": PreTokenizerFamily(splits=_DEEPSEEK_CODER, digits=True),
    # StarCoder-lineage vocabularies (SmolLM, SmolLM2) split every digit, then apply GPT-2's pattern.
    **dict.fromkeys(("smollm", "starcoder", "refact"), PreTokenizerFamily(digits=True, gpt2_split=True)),
    **dict.fromkeys(("gpt2", "gpt-2", "default"), _GPT2),
}


def pre_tokenizer_family(pre: str) -> PreTokenizerFamily:
    """The family of a `tokenizer.ggml.pre` value; GPT-2's, with a warning, for a name not listed."""
    family = _FAMILIES.get(pre)
    if family is None:
        logger.warning("gguf: unknown tokenizer.ggml.pre %r; using GPT-2's split pattern", pre)
        return _GPT2
    return family


def adds_bos_by_default(pre: str) -> bool:
    """Whether llama.cpp puts a BOS in front for this pre-tokenizer when the file has no
    tokenizer.ggml.add_bos_token (Llama 3 files converted before that field existed)."""
    family = _FAMILIES.get(pre)
    return family is not None and family.add_bos


def build_pre_tokenizer(family: PreTokenizerFamily) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    """The `tokenizers` pre-tokenizer (ending in the byte-level mapping) and normalizer of `family`."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False) for pattern in family.splits]
    if family.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family.gpt2_split))
    return (steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)), (
        normalizers.NFC() if family.nfc else None)
