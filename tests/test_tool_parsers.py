"""Tool-call and reasoning parsers on model-style outputs: whole responses, and streams cut at every character.

A stream is the text fed one character longer each time, each parse turned into a delta; the deltas,
concatenated, must equal the parse of the whole response (for well-formed calls), and no input may raise.
"""

from __future__ import annotations

import json

import pytest

from forerun.entrypoints.openai.chat_output import DeltaTracker, MessageParser, ParsedMessage
from forerun.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from forerun.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolSpec
from forerun.entrypoints.openai.tool_parsers.forced import NamedCallParser, RequiredCallsParser

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "when": {"type": "object"}, "ratio": {"type": "number"}}})
NOW = ToolSpec("now", {"type": "object", "properties": {}})
SPECS = [WEATHER, NOW]


def whole(parser: MessageParser, text: str) -> tuple[str | None, str | None, list[tuple[str, dict]]]:
    parsed = parser.parse(text, final=True)
    return parsed.reasoning, parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def streamed(parser: MessageParser, text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """Feed every prefix of `text`, the last as final; the deltas concatenated."""
    tracker = DeltaTracker()
    reasoning, content = "", ""
    calls: list[list[str]] = []
    for i in range(len(text) + 1):
        delta = tracker.delta(parser.parse(text[:i], final=i == len(text)))
        if delta is None:
            continue
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                assert d.index == len(calls) and d.function.name  # announced once, in order, name first
                calls.append([d.function.name, ""])
            calls[d.index][1] += d.function.arguments or ""
    return reasoning or None, content or None, [(n, a) for n, a in calls]


def assert_stream_equals_whole(parser: MessageParser, text: str) -> ParsedMessage:
    final = parser.parse(text, final=True)
    expect = (final.reasoning, final.content, [(c.name, c.arguments) for c in final.calls])
    assert streamed(parser, text) == expect
    return final


def tool_parser(name: str, single_call: bool = False) -> MessageParser:
    return MessageParser(None, TOOL_PARSERS[name](SPECS), single_call)


# (parser, model output, expected content, expected calls)
WELL_FORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a \\"}\\" b", '
               '"when": {"d": [1, {"x": "]"}]}}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n'
               '</tool_call>\n',
     "Let me check both.", [("get_weather", {"city": 'a "}" b', "when": {"d": [1, {"x": "]"}]}}), ("now", {})]),
    ("hermes", 'Sure <tool_call>{"name": "now", "arguments": {}}</tool_call> and then some text',
     "Sure  and then some text", [("now", {})]),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}', None, [("now", {})]),  # cut before the end tag
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b> <tool", "No tools needed: 2 < 3 and <b>bold</b> <tool", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "now", "parameters": {}}',
     None, [("get_weather", {"city": "Oslo"}), ("now", {})]),
    ("llama3_json", '{"name": "get_weather", "arguments": {"days": 2}}', None, [("get_weather", {"days": 2})]),
    ("llama3_json", "It is sunny {mostly}.", "It is sunny {mostly}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "now", "arguments": {}}]',
     None, [("get_weather", {"city": "Rome"}), ("now", {})]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "days": 1}[TOOL_CALLS]now[ARGS]{}',
     "Checking.", [("get_weather", {"city": "Lyon", "days": 1}), ("now", {})]),
    ("mistral", "Plain answer [TOOL", "Plain answer [TOOL", []),
    ("qwen3_xml", "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=when>\n"
                  '{"day": "mon"}\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>\n'
                  "<tool_call>\n<function=now>\n</function>\n</tool_call>",
     "I will look.", [("get_weather", {"city": "New York", "days": 3, "metric": True, "when": {"day": "mon"},
                                       "ratio": 0.5}), ("now", {})]),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n"
                  "</function>", None, [("get_weather", {"city": "line one\nline two"})]),
    ("pythonic", '[get_weather(city="Paris", days=3), now()]', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]),
    ("pythonic", "[get_weather(city='a, b)]', when={'k': [1, None, True]}, ratio=-1.5)]", None,
     [("get_weather", {"city": "a, b)]", "when": {"k": [1, None, True]}, "ratio": -1.5})]),
    ("pythonic", "The answer is [1, 2].", "The answer is [1, 2].", []),
]


@pytest.mark.parametrize("name,text,content,calls", WELL_FORMED,
                         ids=[f"{w[0]}-{i}" for i, w in enumerate(WELL_FORMED)])
def test_parser_whole_and_stream_cut_at_every_character(name, text, content, calls):
    parser = tool_parser(name)
    assert whole(parser, text) == (None, content, calls)
    final = assert_stream_equals_whole(parser, text)
    for c in final.calls:
        assert isinstance(json.loads(c.arguments), dict)


# Text that is no call comes back as content, whole and streamed, and nothing raises.
MALFORMED = [
    ("hermes", "<tool_call>\nget_weather(city=Paris)\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": "soon"}\n</tool_call> then text'),
    ("hermes", '<tool_call>{"name": "now", "arguments": {"x": 1,,}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "now", "argu'),  # cut mid-call by max_tokens
    ("llama3_json", '{"name": "now", "parameters": {"x": }}'),
    ("llama3_json", "{name: now}"),
    ("mistral", "[TOOL_CALLS]not json at all"),
    ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}'),
    ("qwen3_xml", "<tool_call>\n<func>oops</func>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=now>\n<parameter=x>\n1\n"),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", "[get_weather(city=open('f'))]"),
    ("pythonic", "[now(), "),
]


@pytest.mark.parametrize("name,text", MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_calls_are_text(name, text):
    parser = tool_parser(name)
    assert whole(parser, text) == (None, text.strip(), [])
    streamed(parser, text)  # never raises, whatever it had already sent


def test_unparseable_block_text_streams_as_the_same_content():
    parser = tool_parser("hermes")
    text = "Before <tool_call>\nnot a call\n</tool_call> after <tool_call>\n{\"name\": \"now\"}\n</tool_call>"
    final = assert_stream_equals_whole(parser, text)
    assert final.content == "Before <tool_call>\nnot a call\n</tool_call> after"
    assert [(c.name, c.arguments) for c in final.calls] == [("now", "{}")]


def test_arguments_are_sent_in_pieces_after_the_name():
    parser = tool_parser("hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    tracker = DeltaTracker()
    pieces = []
    for i in range(len(text) + 1):
        delta = tracker.delta(parser.parse(text[:i], final=i == len(text)))
        pieces += [d for d in (delta.tool_calls or [])] if delta else []
    assert pieces[0].function.name == "get_weather" and pieces[0].id and pieces[0].type == "function"
    assert all(p.function.name is None and p.id is None for p in pieces[1:]) and len(pieces) > 5
    assert "".join(p.function.arguments or "" for p in pieces) == '{"city": "Paris", "days": 3}'


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
           '"arguments": {"city": "x"}}</tool_call>'
    parser = tool_parser("hermes", single_call=True)
    assert whole(parser, text)[2] == [("now", {})]
    assert_stream_equals_whole(parser, text)


REASONING = [
    ("deepseek_r1", "<think>Two plus two.</think>The answer is 4.", "Two plus two.", "The answer is 4."),
    ("deepseek_r1", "Two plus two.\n</think>\n\n4", "Two plus two.\n", "\n\n4"),
    ("deepseek_r1", "Still thinking when cut <", "Still thinking when cut <", None),
    ("qwen3", "<think>\nParis is in France.\n</think>\n\nParis.", "\nParis is in France.\n", "\n\nParis."),
    ("qwen3", "Paris, no thinking </think> here.", None, "Paris, no thinking </think> here."),
    ("qwen3", "<thin", None, "<thin"),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING, ids=[f"{r[0]}-{i}" for i, r in enumerate(REASONING)])
def test_reasoning_parser_whole_and_stream(name, text, reasoning, content):
    parser = MessageParser(REASONING_PARSERS[name](), None, False)
    assert whole(parser, text) == (reasoning, content, [])
    assert_stream_equals_whole(parser, text)


def test_reasoning_then_tool_call():
    parser = MessageParser(REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](SPECS), False)
    text = '<think>The user wants the time.</think>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert whole(parser, text) == ("The user wants the time.", None, [("now", {})])
    assert_stream_equals_whole(parser, text)


def test_forced_required_calls_stream_and_cut():
    parser = MessageParser(None, RequiredCallsParser(), False)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "when": {"d": [1]}}}, ' \
           '{"name": "now", "parameters": {}}]'
    assert whole(parser, text) == (None, None, [("get_weather", {"city": "Paris", "when": {"d": [1]}}), ("now", {})])
    assert_stream_equals_whole(parser, text)
    cut = parser.parse(text[:50], final=True)  # max_tokens ended it: the call as far as it got
    assert [(c.name, c.arguments) for c in cut.calls] == [("get_weather", text[text.index('{"city"'):50])]


def test_forced_named_call_is_the_whole_output():
    parser = MessageParser(None, NamedCallParser("get_weather"), True)
    text = '{"city": "Paris", "days": 2}'
    assert whole(parser, text) == (None, None, [("get_weather", {"city": "Paris", "days": 2})])
    assert_stream_equals_whole(parser, text)


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "rm_rf", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS]rm_rf[ARGS]{}'),
    ("qwen3_xml", "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>"),
    ("pythonic", "[rm_rf()]"),
])
def test_a_call_of_a_tool_not_offered_is_text(name, text):
    parser = tool_parser(name)
    assert whole(parser, text) == (None, text, [])
    assert_stream_equals_whole(parser, text)  # never announced, so the stream agrees


def test_reply_cut_by_max_tokens_keeps_the_open_call_as_streamed():
    parser = tool_parser("hermes")
    text = 'Calling.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    cut = parser.parse(text, final=True, cut=True)
    assert (cut.content, [(c.name, c.arguments) for c in cut.calls]) == ("Calling.", [("get_weather", '{"city": "Par')])
    tracker = DeltaTracker()
    sent = [tracker.delta(parser.parse(text[:i], final=i == len(text), cut=i == len(text)))
            for i in range(len(text) + 1)]
    args = "".join(d.function.arguments or "" for s in sent if s for d in s.tool_calls or [])
    assert args == '{"city": "Par'
    assert parser.parse(text, final=True).calls == []  # without the cut it is text
