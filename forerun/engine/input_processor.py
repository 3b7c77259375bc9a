"""Turns a user's prompt and sampling params into engine-core requests, rejecting bad input early."""

from __future__ import annotations

import dataclasses
import itertools
import time

from forerun.core.request_queue import check_priority
from forerun.engine.tokenizer import Tokenizer
from forerun.request import EngineCoreRequest
from forerun.sampling_params import SamplingParams, check_token_ids

# A text, token ids, or vLLM's dict form: {"prompt": text} or {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict


class InputProcessor:
    """Validates and tokenizes. Every error is a ValueError naming the field at fault.

    With `refuse_overlong_max_tokens` a `max_tokens` that cannot fit after the prompt is refused
    (the server's behaviour, as OpenAI and vLLM's server answer 400); without it such a request
    runs until `max_model_len` and finishes with "length" (the offline `LLM`'s behaviour).
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int,
                 scheduling_policy: str = "fcfs", refuse_overlong_max_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.scheduling_policy = scheduling_policy
        self.refuse_overlong_max_tokens = refuse_overlong_max_tokens
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            prompt = _from_dict(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            check_token_ids("prompt", prompt, self.vocab_size)
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0
                ) -> tuple[str | None, list[int], list[EngineCoreRequest]]:
        """One core request per completion (n > 1 fans out, each child with its own seed and the same
        priority)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        check_priority(priority, self.scheduling_policy)
        params.validate()
        if params.bad_words:
            # A copy, so the caller's params never carry one tokenizer's ids to another engine.
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_words_token_ids(params))
        params.validate_token_ids(self.vocab_size)
        text, ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens is too long for max_model_len {self.max_model_len} "
                             "(at least one output token must fit)")
        room = self.max_model_len - len(ids)
        if self.refuse_overlong_max_tokens and params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens: {params.max_tokens} is more than fit after this prompt of {len(ids)} "
                             f"tokens: max_model_len is {self.max_model_len}, so at most {room}")
        now = time.monotonic()
        eos = self.tokenizer.eos_token_ids
        if params.n == 1:
            return text, ids, [EngineCoreRequest(request_id, ids, params, eos, now, priority=priority)]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = dataclasses.replace(params, n=1, seed=seed)
            children.append(EngineCoreRequest(child_id(request_id, i), ids, child, eos, now, priority=priority))
        return text, ids, children

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """The token sequences to ban for `params.bad_words` (plus any ids it already carries).

        Each word is encoded as it starts a text and after a space, since BPE vocabularies spell the two
        with different tokens ("Paris" vs " Paris"); duplicates and empty encodings are dropped."""
        seqs: dict[tuple[int, ...], None] = {tuple(w): None for w in params.bad_words_token_ids or ()}
        for word in params.bad_words or ():
            bare = word.lstrip()
            for text in (bare, " " + bare):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    seqs[ids] = None
        return [list(ids) for ids in seqs]

    def process_pooling(self, request_id: str, prompt: Prompt) -> tuple[str | None, list[int], EngineCoreRequest]:
        """One pooling request: the whole prompt is the input; nothing is generated."""
        text, ids = self.tokenize(prompt)
        if len(ids) > self.max_model_len:
            raise ValueError(f"input: {len(ids)} tokens exceed the model's limit of {self.max_model_len}")
        params = SamplingParams(max_tokens=None, temperature=0.0)
        return text, ids, EngineCoreRequest(request_id, ids, params, frozenset(), time.monotonic(), pooling=True)


def _from_dict(prompt: dict) -> str | list[int]:
    """vLLM's prompt dicts: {"prompt_token_ids": [...]} (TokensPrompt) or {"prompt": "..."} (TextPrompt)."""
    keys = set(prompt)
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids: expected a list of token ids, got {type(ids).__name__}")
        return list(ids)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    raise ValueError(f"prompt: a dict prompt needs exactly one key, 'prompt_token_ids' (a list of ids) or "
                     f"'prompt' (a string); got keys {sorted(keys)}")


def child_id(parent: str, index: int) -> str:
    return f"{parent}#{index}"
