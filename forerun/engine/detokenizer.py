"""Incremental detokenization and stop-string detection for one request's output stream."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from forerun.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["IncrementalDetokenizer"]

# How many prompt tokens to decode in front of the first output token: decoders such as
# SentencePiece's render a token differently at the start of a text than after other text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a multi-byte character,
    and finds stop strings.

    Invariants:
    - the concatenation of every delta returned by `update` (and `flush`) equals `text`;
    - without stop strings, after `flush` `text == tokenizer.decode(output_ids)` for
      byte-level BPE tokenizers, however the ids were split across `update` calls;
    - a delta never ends in an incomplete UTF-8 sequence (no trailing U+FFFD from a split
      character) and never contains the start of a stop string that is not yet ruled out;
    - once `stop_reason` is set, `text` ends at the stop string (or just after it when
      `include_stop_str_in_output`) and `update` refuses further tokens.

    Cost per update is bounded by the window of ids since the last emitted text (usually the
    new ids plus the previous chunk), not by the length of the output.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True) -> None:
        if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop: expected a sequence of strings")
        if any(s == "" for s in stop):
            raise ValueError("stop: stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self._include_stop = include_stop_str_in_output
        # `tokenizers` renders special tokens through the model's own decoder (as fast
        # tokenizers in `transformers` do), so this flag has nothing to change; it is kept so
        # sampling parameters pass straight through.
        self._spaces_between_special_tokens = spaces_between_special_tokens

        # `_ids[_prefix:_read]` was already turned into text; `_ids[_read:]` is not visible yet.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            # The prompt ends mid-character; decoding the output after it would shift text.
            context = []
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

        self._chunks: list[str] = []    # visible deltas, joined lazily by `text`
        self._text_cache: str | None = ""
        self._held = ""                  # decoded text held back: could be the start of a stop string
        self._stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All visible output text so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, once one is hit."""
        return self._stop_reason

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the text they make visible (possibly "")."""
        if self._stop_reason is not None:
            raise RuntimeError(f"update: stop string {self._stop_reason!r} was already hit")
        self._ids.extend(new_token_ids)
        return self._release(self._decode_new())

    def update_until_stop(self, new_token_ids: Sequence[int]) -> tuple[str, int]:
        """Feed ids that arrived together (accepted drafts); return the visible text and how many of the
        ids belong to the output: all of them, unless a stop string is hit, then those up to and
        including the one that completed it.

        With stop strings the ids go in one at a time, exactly as one-token steps would feed them, so a
        stop string ends the output at the same token (with the same text) as it does without drafts.
        """
        if not self._stops or len(new_token_ids) <= 1:
            return self.update(new_token_ids), len(new_token_ids)
        parts: list[str] = []
        for i, tok in enumerate(new_token_ids):
            parts.append(self.update((tok,)))
            if self._stop_reason is not None:
                return "".join(parts), i + 1
        return "".join(parts), len(new_token_ids)

    def flush(self) -> str:
        """Release text still held back, for a request that ended for another reason (EOS,
        length): the tail of a partial stop string and any incomplete character."""
        if self._stop_reason is not None:
            return ""
        tail = ""
        if self._read < len(self._ids):
            decode = self._tokenizer.decode
            old = decode(self._ids[self._prefix:self._read], self._skip_special)
            tail = decode(self._ids[self._prefix:], self._skip_special)[len(old):]
            self._prefix = self._read = len(self._ids)
        delta = self._held + tail
        self._held = ""
        self._emit(delta)
        return delta

    def _decode_new(self) -> str:
        """Decode the window of recent ids and return only the text past what was emitted.

        Returns "" while the window ends in U+FFFD: the last token ends part-way through a
        multi-byte character whose remaining bytes are still to come.
        """
        if self._read == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        old = decode(self._ids[self._prefix:self._read], self._skip_special)
        new = decode(self._ids[self._prefix:], self._skip_special)
        if len(new) <= len(old) or new.endswith(_REPLACEMENT_CHAR):
            # Either nothing printable yet (e.g. a skipped special token) or a split character.
            # Advance past ids that add no text only when the window is clean, so a pending
            # character's leading bytes are never dropped from the window.
            if not new.endswith(_REPLACEMENT_CHAR) and new == old:
                self._read = len(self._ids)
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new[len(old):]

    def _release(self, new_text: str) -> str:
        """Search stop strings in the held tail plus the new text; return what may be shown."""
        if not new_text:
            return ""
        buffer = self._held + new_text
        if not self._stops:
            self._held = ""
            self._emit(buffer)
            return buffer
        # Everything before `_held` was emitted and, by construction, holds no partial stop
        # string, so a match can only start inside `buffer`.
        hit_at, hit = -1, ""
        for s in self._stops:
            at = buffer.find(s)
            if at != -1 and (hit_at == -1 or at < hit_at):
                hit_at, hit = at, s
        if hit_at != -1:
            end = hit_at + len(hit) if self._include_stop else hit_at
            self._stop_reason = hit
            self._held = ""
            delta = buffer[:end]
            self._emit(delta)
            return delta
        keep = self._partial_stop_len(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        delta = buffer[:len(buffer) - keep]
        self._emit(delta)
        return delta

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, delta: str) -> None:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None
