"""Deterministic bad request bodies for the server fuzz test: one field of a valid body replaced at a time."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

WRONG_TYPES: list[Any] = ["x", True, None, [], {}, [1, "a"], {"a": 1}, 1.5, [[[]]]]
OUT_OF_RANGE: list[Any] = [-1, 0, -10**9, 10**9, 2**63, 2**64, 2**70, -2**70, 10**30, 1e308, -1e308,
                           float("inf"), float("-inf"), float("nan"), 1e-320]
STRINGS: list[Any] = ["", " ", "\x00", "\ud800", "😀" * 300, "Ω≈ç√∫ 中文 עִבְרִית", "\n\t\r", "null", "a" * 20_000,
                      "<|endoftext|>", "{{ raise_exception('x') }}"]

COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
                     "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "stream",
                     "stream_options", "response_format", "ignore_eos", "min_tokens", "skip_special_tokens",
                     "include_stop_str_in_output", "user", "logprobs", "echo", "suffix", "best_of",
                     "structured_outputs", "guided_choice", "prompt_logprobs", "unknown_field"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "logprobs", "echo", "suffix", "best_of")] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt", "chat_template_kwargs",
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"]
EMBEDDING_FIELDS = ["model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"]

# Values aimed at one field's structure, beyond the generic ones.
SPECIFIC: dict[str, list[Any]] = {
    "prompt": [[], [[]], [-1], [[1, 2], []], [2**40], ["a", 1], [""], "\ud800", ["ok", "a\udfffb"], "x" * 3_000_000],
    "input": [[], [[]], [-1], [[1, 2], []], [2**40], ["a", 1], [""], ["x"] * 3000, [[0] * 600], "\ud800",
              ["fine", "\udfff"], "x" * 3_000_000],
    "messages": [[], [{"role": "user"}], [{"content": "hi"}], [{"role": "bogus", "content": "hi"}],
                 [{"role": 5, "content": "hi"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": {}}],
                 [{"role": "assistant", "content": "only me"}], [{"role": "user", "content": "x", "name": 5}],
                 [{"role": "user", "content": "\ud800"}], [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
                 [{"role": "developer", "content": "hi"}], [{"role": "tool", "content": "1", "tool_call_id": "c"}],
                 [{"role": "user", "content": "hi", "tool_calls": []}], [{"role": "function", "content": "hi"}]],
    "structured_outputs": [{}, {"choice": []}, {"choice": [""]}, {"choice": ["a", 5]}, {"regex": ""}, {"regex": "("},
                           {"grammar": "root ::= "}, {"grammar": "nonsense"}, {"json": 5}, {"json": "{"},
                           {"json": {"type": "bogus"}}, {"json_object": False}, {"whitespace_pattern": " "},
                           {"choice": ["a"], "regex": "a"}, {"choice": ["yes", "no"]}, {"regex": "[ab]{2}"},
                           {"json_object": True}, {"choice": ["\ud800"]}],
    "tools": [[], [{"type": "function", "function": {"name": "f"}}]],
    "tool_choice": ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}],
    "response_format": [{"type": "bogus"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
                        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}},
                        {"type": "json_schema", "json_schema": {"schema": 5}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "("}}},
                        {"type": "json_object"}],
    "stream_options": [{"include_usage": "x"}, {"include_usage": True}],
    "stop": [[""], ["a"] * 1000, [None], ["x" * 10_000], ["\ud800"], "\udfff"],
    "stop_token_ids": [[-1], [2**64], [None], list(range(5000))],
    "chat_template_kwargs": [{"add_generation_prompt": "x"}, {"tools": 5}, {"messages": 1}, {"x" * 100: None},
                             {"documents": [1, 2]}],
    "encoding_format": ["float32", "base64 "],
}


def mutations(fields: list[str], rng: random.Random, per_field: int) -> Iterator[tuple[str, Any]]:
    """(field, value) pairs: every field gets `per_field` generic values (some of each kind) plus its specific ones."""
    for name in fields:
        generic = (rng.sample(WRONG_TYPES, 3) + rng.sample(OUT_OF_RANGE, per_field // 2)
                   + rng.sample(STRINGS, per_field - 3 - per_field // 2))
        for value in generic + SPECIFIC.get(name, []):
            yield name, value
