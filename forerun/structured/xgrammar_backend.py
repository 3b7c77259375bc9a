"""Structured output with xgrammar: vocabulary from tokenizer.json, cached compiles, matchers.

The tokenizer is read with the `tokenizers` library only (no `transformers` here), although
xgrammar itself imports `transformers` when it is imported.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import tokenizers
import torch
import xgrammar as xgr

from forerun.byte_alphabet import byte_level_alphabet
from forerun.structured.backend import CompiledGrammar, StructuredOutputBackend, StructuredOutputGrammar
from forerun.structured.spec import (
    KIND_CHOICE,
    KIND_GRAMMAR,
    KIND_JSON,
    KIND_JSON_OBJECT,
    KIND_REGEX,
    GrammarKey,
    choice_to_ebnf,
)

logger = logging.getLogger(__name__)

# xgrammar prefixes its errors with "[time] /path/file.cc:line: "; users need only the rest.
_XGR_ERROR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def _decoder_types(decoder: dict[str, Any] | None) -> Iterator[str]:
    if not decoder:
        return
    yield decoder.get("type", "")
    for inner in decoder.get("decoders", None) or []:
        yield from _decoder_types(inner)


def detect_vocab_type(tokenizer_json: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    """(how vocabulary strings encode bytes, whether tokenization prepends a space).

    The decoder says how token strings map back to bytes: ByteLevel means the GPT-2 alphabet,
    ByteFallback means SentencePiece style "<0x0A>" and "▁"; anything else is taken as raw text.
    """
    types = set(_decoder_types(tokenizer_json.get("decoder")))
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, bool(pre.get("add_prefix_space", False))
    if "ByteFallback" in types:
        normalizer = json.dumps(tokenizer_json.get("normalizer") or {})
        prepends = '"Prepend"' in normalizer or pre.get("prepend_scheme") in ("always", "first")
        return xgr.VocabType.BYTE_FALLBACK, prepends
    return xgr.VocabType.RAW, False


def read_eos_token_ids(folder: Path, tokenizer: tokenizers.Tokenizer) -> list[int]:
    """Every id that ends generation according to the model folder's config files."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
    path = folder / "tokenizer_config.json"
    if path.is_file():
        token = json.loads(path.read_text()).get("eos_token")
        if isinstance(token, dict):  # older files store an AddedToken as a dict
            token = token.get("content")
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            ids.add(tokenizer.token_to_id(token))
    return sorted(ids)


def build_tokenizer_info(
    tokenizer_folder: Path, vocab_size: int, eos_token_ids: Sequence[int] | None = None
) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, sized to the model's vocabulary.

    Special added tokens (chat markers, padding) get an empty string, which xgrammar never
    allows inside a grammar: otherwise a rule like `.*` would let the model emit
    "<|im_start|>" as text. Stop tokens are allowed by id where the grammar may end.
    Ids past the tokenizer's vocabulary (padded embeddings) are empty too, so never allowed.
    """
    path = Path(tokenizer_folder) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer_folder: no tokenizer.json in {tokenizer_folder}")
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    vocab_type, add_prefix_space = detect_vocab_type(json.loads(path.read_text()))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokenizer_size = max(vocab.values()) + 1
    if tokenizer_size > vocab_size:
        # Ids the model cannot produce need no mask entry.
        logger.warning("tokenizer has %d ids but the model only %d; ignoring the rest", tokenizer_size, vocab_size)
    encoded = [""] * vocab_size
    for text, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = text
    alphabet = byte_level_alphabet()
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if token_id >= vocab_size:
            continue
        if added.special:
            encoded[token_id] = ""
        elif vocab_type == xgr.VocabType.BYTE_LEVEL:
            # Added tokens are stored as plain text, not in the byte-level alphabet.
            encoded[token_id] = "".join(alphabet[b] for b in added.content.encode("utf-8"))
    stops = list(eos_token_ids) if eos_token_ids is not None else read_eos_token_ids(Path(tokenizer_folder), tokenizer)
    if not stops:
        raise ValueError(f"eos_token_ids: none given and none found in the config files of {tokenizer_folder}")
    if any(not 0 <= s < vocab_size for s in stops):
        raise ValueError(f"eos_token_ids: {stops} must lie in [0, {vocab_size})")
    return xgr.TokenizerInfo(
        encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stops, add_prefix_space=add_prefix_space
    )


def _clean_error(exc: BaseException) -> str:
    return _XGR_ERROR_PREFIX.sub("", str(exc)).strip()


class XGrammarGrammar(StructuredOutputGrammar):
    """One request's xgrammar matcher.

    Invariant: `num_accepted_tokens` equals the matcher's rollback history length, so
    `rollback(n)` with n <= num_accepted_tokens always succeeds.
    """

    def __init__(self, compiled: CompiledGrammar) -> None:
        assert isinstance(compiled.handle, xgr.CompiledGrammar)
        self.key = compiled.key
        # max_rollback_tokens=-1 keeps the whole history so any accepted token can be undone.
        self._matcher = xgr.GrammarMatcher(compiled.handle, max_rollback_tokens=-1)
        self._num_accepted = 0

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted

    def accept_tokens(self, req_id: str, token_ids: Sequence[int]) -> bool:
        accepted = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(int(token_id)):
                logger.debug("request %s: grammar rejected token %d", req_id, token_id)
                if accepted:
                    self._matcher.rollback(accepted)
                return False
            accepted += 1
        self._num_accepted += accepted
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"num_tokens: {num_tokens} is outside [0, {self._num_accepted}]")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def reset(self) -> None:
        self._matcher.reset()
        self._num_accepted = 0


class XGrammarBackend(StructuredOutputBackend):
    """xgrammar behind the backend interface, with an LRU cache of compiled grammars.

    Invariant: at most `cache_size` compiled grammars are kept; a key being compiled is compiled
    by exactly one thread while others wait for its result. Failed compiles are not cached.
    """

    def __init__(
        self,
        tokenizer_folder: Path,
        vocab_size: int,
        *,
        eos_token_ids: Sequence[int] | None = None,
        compile_threads: int = 1,
        cache_size: int = 256,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        if cache_size <= 0:
            raise ValueError(f"cache_size: must be positive, got {cache_size}")
        self.vocab_size = vocab_size
        self.tokenizer_info = build_tokenizer_info(tokenizer_folder, vocab_size, eos_token_ids)
        # Our own cache is keyed on the canonical spec; xgrammar's second cache would only
        # duplicate memory.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads, cache_enabled=False)
        self._cache: OrderedDict[GrammarKey, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiles = 0  # grammars actually compiled (cache misses), for tests and metrics

    def validate(self, key: GrammarKey) -> None:
        self._parse(key)

    def compile(self, key: GrammarKey) -> CompiledGrammar:
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if future is None:
                future = Future()
                self._cache[key] = future
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                compiled = CompiledGrammar(key, self._compiler.compile_grammar(self._parse(key)))
            except BaseException as exc:
                with self._lock:
                    if self._cache.get(key) is future:
                        del self._cache[key]
                if isinstance(exc, RuntimeError):  # how xgrammar reports a bad grammar
                    exc = ValueError(f"structured_outputs.{key[0]}: failed to compile: {_clean_error(exc)}")
                future.set_exception(exc)  # threads waiting on this key see the same error
                raise exc from None
            with self._lock:
                self.num_compiles += 1
            future.set_result(compiled)
        return future.result()

    def new_grammar(self, compiled: CompiledGrammar) -> XGrammarGrammar:
        return XGrammarGrammar(compiled)

    def close(self) -> None:
        with self._lock:
            self._cache.clear()

    def _parse(self, key: GrammarKey) -> xgr.Grammar:
        """Spec text -> xgrammar Grammar: cheap (no vocabulary work), raises ValueError."""
        kind, text = key
        try:
            if kind == KIND_JSON:
                # strict_mode: properties the schema does not name are not generated.
                return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == KIND_JSON_OBJECT:
                # Not strict: any object (the builtin JSON grammar would also allow arrays).
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == KIND_REGEX:
                return xgr.Grammar.from_regex(text)
            if kind == KIND_CHOICE:
                return xgr.Grammar.from_ebnf(choice_to_ebnf(json.loads(text)))
            if kind == KIND_GRAMMAR:
                return xgr.Grammar.from_ebnf(text)
        except RuntimeError as exc:
            raise ValueError(f"structured_outputs.{kind}: {_clean_error(exc)}") from None
        raise ValueError(f"structured_outputs: unknown kind {kind!r}")
