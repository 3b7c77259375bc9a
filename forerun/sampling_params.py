"""What a user asks of one generation, validated once at submission."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from forerun.structured.spec import StructuredOutputsParams

OUTPUT_KINDS = ("cumulative", "final_only")


@dataclass
class SamplingParams:
    """Sampling and stopping options for one prompt.

    Invariant after `validate()`: every field is within its documented range, so the
    scheduler and worker never re-check user input.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's prompt_logprobs: for every prompt token after the first, its logprob and the top k of the raw
    # model distribution at that position. Such a request takes no prefix-cache hits (each position must
    # be computed), and is refused with speculative decoding or pipeline parallelism.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # "cumulative": an output every step (text so far and this step's delta), for streaming;
    # "final_only": one output when the request ends (vLLM's FINAL_ONLY), what `LLM.generate` uses.
    # Without stop strings a final-only request's text is decoded once at the end, not every step, and
    # without logprobs too the engine core sends its tokens once, at the end.
    output_kind: str = "cumulative"
    # A dict of StructuredOutputsParams' fields is accepted and converted.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to that token's logit before any
    # sampling step, greedy included (-100 in practice bans the token, +100 in practice forces it).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: only these ids may be sampled (non-empty).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: never generated. Each word is banned with and without a leading space; a word of
    # several tokens bans its last token only right after the generated tokens spelled its other ones.
    bad_words: list[str] | None = None
    # The token ids the engine bans as words: filled from `bad_words` when the request is submitted
    # (ids given here directly are banned too).
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's detokenize: False returns token ids only (text stays ""), as RL trainers want; no stop strings.
    detokenize: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def uses_logit_controls(self) -> bool:
        """Whether the worker must edit this request's logits for logit_bias, allowed_token_ids or bad words."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(0.0 <= self.temperature < math.inf, "temperature", f"must be finite and >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        # Bounded so it fits the worker's int64 tensors; any k past the vocabulary means "off" anyway.
        _check(isinstance(self.top_k, int) and 0 <= self.top_k < 2**31, "top_k",
               f"must be 0 or -1 (off) or a positive integer below 2**31, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(0.0 < self.repetition_penalty < math.inf, "repetition_penalty",
               f"must be finite and > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        # A torch generator takes a 64-bit seed; n > 1 gives completion i the seed `seed + i`.
        _check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed
                                     and self.seed + self.n - 1 < 2**64), "seed",
               f"must be an integer in [-2**63, 2**64 - n), got {self.seed!r}")
        _check(self.output_kind in OUTPUT_KINDS, "output_kind",
               f"must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.stop is not None:
            _check(all(isinstance(s, str) and s for s in self.stop), "stop",
                   "must be a non-empty string or a list of non-empty strings")
        _check(isinstance(self.detokenize, bool), "detokenize", f"expected a bool, got {self.detokenize!r}")
        _check(self.detokenize or not self.stop, "detokenize",
               "stop strings are found in the text: with detokenize=False use stop_token_ids instead")
        if self.stop_token_ids is not None:
            _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                   "must be a list of non-negative integers")
        if isinstance(self.structured_outputs, dict):  # also when assigned after construction
            self.structured_outputs = _structured_from_dict(self.structured_outputs)
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   f"expected StructuredOutputsParams or a dict of its fields, got "
                   f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
        self._validate_logit_controls()

    def _validate_logit_controls(self) -> None:
        """logit_bias, allowed_token_ids, bad_words and their ids; logit_bias is normalised to {int: float}."""
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias",
                   f"expected a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            bias: dict[int, float] = {}
            for tok, value in self.logit_bias.items():
                _check(_is_int(tok) and tok >= 0, "logit_bias", f"keys must be token ids (integers >= 0), got {tok!r}")
                # As OpenAI: a bias outside [-100, 100] is refused rather than clamped.
                _check(_is_number(value) and -100.0 <= value <= 100.0, "logit_bias",
                       f"bias for token {tok} must be a number in [-100, 100], got {value!r}")
                bias[tok] = float(value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, list) and len(self.allowed_token_ids) > 0
                   and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids",
                   "must be a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   "bad_words", "must be a list of strings, each with some non-space character")
        if self.bad_words_token_ids is not None:
            _check(isinstance(self.bad_words_token_ids, list) and all(
                isinstance(w, list) and w and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_token_ids),
                "bad_words", "token ids must be a list of non-empty lists of token ids (integers >= 0)")

    def validate_token_ids(self, vocab_size: int) -> None:
        """Every token id these params carry must index a logit: checked once the vocabulary is known."""
        check_token_ids("stop_token_ids", self.stop_token_ids or (), vocab_size)
        check_token_ids("logit_bias", list(self.logit_bias or ()), vocab_size)
        check_token_ids("allowed_token_ids", self.allowed_token_ids or (), vocab_size)
        check_token_ids("bad_words", [t for w in self.bad_words_token_ids or () for t in w], vocab_size)


def final_only(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """Copies asking for one output per request, at its end (the caller's objects are left as they are;
    one copy per distinct object): what `LLM.generate` and the offline bench need, with the text then
    decoded once instead of every step."""
    copies: dict[int, SamplingParams] = {}
    for sp in params:
        if id(sp) not in copies:
            copies[id(sp)] = replace(sp, output_kind="final_only")
    return [copies[id(sp)] for sp in params]


def check_token_ids(name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """ValueError naming `name` when an id lies outside [0, vocab_size).

    Such an id would index past the logits on the worker and fail the whole step, and with it every
    request in flight, so it must be refused when its request is submitted.
    """
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def _structured_from_dict(spec: dict[str, Any]) -> StructuredOutputsParams:
    known = [f.name for f in fields(StructuredOutputsParams)]
    unknown = sorted(set(spec) - set(known), key=str)
    _check(not unknown, "structured_outputs", f"unknown field(s) {unknown}; expected one of {', '.join(known)}")
    return StructuredOutputsParams(**spec)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
