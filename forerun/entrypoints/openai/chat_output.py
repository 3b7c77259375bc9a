"""One chat choice's text as the assistant message: reasoning, content and tool calls, whole or streamed.

`MessageParser.parse(text, final)` applies the reasoning parser, then the tool parser to what is left.
`DeltaTracker` turns the parses of a growing text into stream deltas: it sends only what was added, so
the concatenated deltas equal the final parse (the parsers' prefix invariant guarantees they only grow).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from forerun.entrypoints.openai.protocol import DeltaMessage
from forerun.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from forerun.entrypoints.openai.reasoning_parsers import ReasoningParser
from forerun.entrypoints.openai.tool_parsers import ParsedCall, ToolParser


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedMessage:
    reasoning: str | None
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class MessageParser:
    """Invariant: with neither parser, the content is the text unchanged; with `single_call`
    (parallel_tool_calls false) at most the first call is kept."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, single_call: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.single_call = single_call

    @property
    def passthrough(self) -> bool:
        """True when the content is the text as generated (no parser applies)."""
        return self.reasoning is None and self.tools is None

    def parse(self, text: str, final: bool, cut: bool = False) -> ParsedMessage:
        """`cut`: the text ended at max_tokens, so a call it left open is kept as far as it got (as it
        was streamed), not turned into text."""
        if self.passthrough:
            return ParsedMessage(None, text)
        reasoning: str | None = None
        content = text
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            reasoning, content = split.reasoning, split.content
        calls: list[ParsedCall] = []
        if self.tools is not None:
            parsed = self.tools.parse(content, final and not cut)
            content, calls = parsed.content, parsed.calls
            if final:
                calls = [c for c in calls if c.name is not None]
            if self.single_call:
                calls = calls[:1]
        if final:  # an empty field is absent from the response
            return ParsedMessage(reasoning or None, content or None, calls)
        return ParsedMessage(reasoning, content, calls)

    def tool_calls(self, parsed: ParsedMessage) -> list[ToolCall] | None:
        """The final calls as the response's `message.tool_calls` (None when there are none)."""
        calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls if c.name is not None]
        return calls or None


class DeltaTracker:
    """What one streamed choice has sent so far.

    Invariant: the sent reasoning, content and each call's arguments are prefixes of the latest parse;
    a call is announced (id and name) once, before any of its arguments, and calls in index order.
    """

    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.call_ids: list[str] = []
        self.call_args: list[int] = []  # characters of each call's arguments sent

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def delta(self, parsed: ParsedMessage) -> DeltaMessage | None:
        """The delta from what was sent to `parsed`, or None when nothing is new."""
        reasoning = _added(self.reasoning, parsed.reasoning or "")
        content = _added(self.content, parsed.content or "")
        self.reasoning += reasoning
        self.content += content
        calls: list[DeltaToolCall] = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a later call may not be announced before this one
            if index == len(self.call_ids):
                self.call_ids.append(tool_call_id())
                self.call_args.append(0)
                calls.append(DeltaToolCall(index=index, id=self.call_ids[index],
                                           function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                self.call_args[index] = len(call.arguments)
            elif len(call.arguments) > self.call_args[index]:
                piece = call.arguments[self.call_args[index]:]
                calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)))
                self.call_args[index] = len(call.arguments)
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None, tool_calls=calls or None)


def _added(sent: str, now: str) -> str:
    """What `now` adds to `sent`. A parse that took back sent text (only malformed calls do, see the
    parsers) adds nothing until it grows past what was sent."""
    if now.startswith(sent):
        return now[len(sent):]
    return ""
