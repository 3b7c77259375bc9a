"""Reasoning parsers (`--reasoning-parser`, vLLM's names): split `<think>...</think>` off the answer.

`deepseek_r1`: the chat template opens the think block, so the output starts inside it: everything up to
`</think>` is reasoning (a leading `<think>` the model writes anyway is dropped); a response that never
closes the block is all reasoning. `qwen3`: reasoning only inside a `<think>...</think>` the model
writes at the very start; without one the response is all content (as with `enable_thinking: false`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from forerun.entrypoints.openai.tool_parsers.base import held_back

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str


class ReasoningParser(ABC):
    """Invariant: for a prefix `p` of `t`, `split(p, final=False)` has reasoning and content that are
    prefixes of those of `split(t, final=True)` (reasoning None counts as empty)."""

    @abstractmethod
    def split(self, text: str, final: bool) -> Split:
        """Reasoning and content of `text`; with `final=False`, only what later text cannot change."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if body.startswith(THINK):
            body = body[len(THINK):]
        elif not final and THINK.startswith(body):
            return Split(None, "")
        end = body.find(END_THINK)
        if end < 0:
            return Split(body if final else held_back(body, (END_THINK,)), "")
        return Split(body[:end], body[end + len(END_THINK):])


class Qwen3ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if not body.startswith(THINK):
            if not final and THINK.startswith(body):
                return Split(None, "")  # may still open a think block
            return Split(None, text)
        body = body[len(THINK):]
        end = body.find(END_THINK)
        if end < 0:
            return Split(body if final else held_back(body, (END_THINK,)), "")
        return Split(body[:end], body[end + len(END_THINK):])


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
