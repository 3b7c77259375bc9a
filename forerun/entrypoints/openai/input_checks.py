"""Checks a request's text passes before any tokenizing: valid Unicode, and a size the context can hold.

Tokenizing is the one per-request cost that grows with the client's input, so it must never be what
finds an input too large: a 10 MB prompt once took seconds of the event loop (every other request and
/health stalled) only to be refused for its token count. Text here is refused by its length in
characters first, and what passes is tokenized on a worker thread (the Rust tokenizer's batch call
releases the GIL, so the loop keeps running meanwhile).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from forerun.engine.tokenizer import Tokenizer

# Normalizers may merge characters before tokenizing (NFC folds a letter and its combining mark into
# one), so one vocabulary character can stand for more than one input character. Two per character
# covers a combining mark on every letter; more than that is no text a person writes.
CHARS_PER_TOKEN_CHAR = 2

_SCALARS = frozenset({int, float, bool, type(None)})


def find_lone_surrogate(value: Any, path: str) -> str | None:
    """The path (`messages[0].content`) of the first string under `value` that is not valid Unicode.

    JSON's `"\\ud800"` decodes to a Python string with a lone surrogate, which has no UTF-8 form: the
    tokenizer raises TypeError on it and a response echoing it cannot be encoded.
    """
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            found = find_lone_surrogate(getattr(value, name), _join(path, field.alias or name))
            if found:
                return found
        for name, extra in (value.model_extra or {}).items():
            found = find_lone_surrogate(extra, _join(path, name))
            if found:
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_lone_surrogate(key, _join(path, "<key>")) or find_lone_surrogate(item, _join(path, str(key)))
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        if set(map(type, value)) <= _SCALARS:  # token ids: no Python-level loop over a long list
            return None
        for i, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def check_unicode(request: BaseModel) -> None:
    """ValueError naming the first field of `request` holding a lone surrogate."""
    field = find_lone_surrogate(request, "")
    if field is not None:
        raise ValueError(f"{field}: not valid Unicode (a lone surrogate such as \\ud800); "
                         "send text as UTF-8 or as escaped surrogate pairs")


def _join(path: str, name: str) -> str:
    # A key holding a surrogate cannot name itself; `<key>` marks the place instead.
    return f"{path}.{name}" if path else name


class TextLimit:
    """The most characters a prompt may have: more than that cannot fit in `max_model_len` tokens.

    Invariant: `max_chars >= max_model_len * tokenizer.max_token_chars`, so every text refused here
    would also be refused after tokenizing, save one whose tokenizer drops most of it (BERT drops
    whitespace runs): such a text is refused here although it might fit, which no real input needs.
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * tokenizer.max_token_chars * CHARS_PER_TOKEN_CHAR

    def check(self, field: str, num_chars: int) -> None:
        if num_chars > self.max_chars:
            raise ValueError(
                f"{field}: {num_chars} characters cannot fit in max_model_len {self.max_model_len} tokens "
                f"(this tokenizer's longest token covers at most {self.tokenizer.max_token_chars} characters, "
                f"so at most {self.max_chars} characters are accepted)")

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, tokenized on a worker thread. Check the sizes first."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.tokenizer.encode_batch, texts, add_special_tokens)
