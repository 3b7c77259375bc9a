"""Tool calling end to end: a real `forerun serve` of the default model and the official openai client.

Forced calls (`tool_choice` "required" or a named function) are generated under a grammar built from
the tools' schemas, so even the 135 M default model must produce calls whose arguments validate.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from serve_helpers import serving, start_server, stop_server

MAX_TOKENS = 64


def tool(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    params = {"type": "object", "properties": properties, "required": required or list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


WEATHER = tool("get_weather", "Current weather in a city", {
    "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}})
ADD = tool("add", "Add whole numbers", {
    "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000}, "minItems": 2,
                "maxItems": 4}})
BOOK = tool("book_flight", "Book a flight", {
    "trip": {"type": "object", "properties": {
        "origin": {"type": "string", "enum": ["Rome", "Oslo", "Paris", "Lima"]},
        "destination": {"type": "string", "enum": ["Rome", "Oslo", "Paris", "Lima"]},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["origin", "destination", "passengers"]},
    "cabin": {"type": "string", "enum": ["economy", "business"]}})
CALENDAR = tool("add_event", "Put an event in the calendar", {
    "event": {"type": "object", "properties": {
        "day": {"type": "string", "enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "guests": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
        "required": ["day", "hour", "guests"]}})
SHOP = tool("order", "Order items from the shop", {
    "items": {"type": "array", "maxItems": 2, "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "enum": ["apple", "bread", "milk"]}, "qty": {"type": "integer", "minimum": 1,
                                                                            "maximum": 12}},
        "required": ["sku", "qty"]}},
    "express": {"type": "boolean"}})
NOW = tool("now", "The current time", {})

# (tools offered, question): five tool sets with enums, nested objects, arrays and integers.
TOOL_SETS = [
    ([WEATHER, NOW], "What is the weather in Paris in celsius?"),
    ([ADD, WEATHER], "What is 12 plus 30?"),
    ([BOOK, NOW], "Book a business flight from Rome to Oslo for 2 people."),
    ([CALENDAR], "Add a meeting on tuesday at 10 with Ana and Bo."),
    ([SHOP, ADD], "Order 3 apples and 1 milk, express."),
]


SERVER_ARGS = ("--served-model-name", "smol", "--max-model-len", "2048", "--tool-call-parser", "hermes",
               "--enable-auto-tool-choice", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def server():
    yield from serving(None, *SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, question: str, tools: list[dict], **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}],
                                          tools=tools, temperature=0.0, **kw)


def check_calls(calls, tools: list[dict], forced: bool = True) -> list[tuple[str, dict]]:
    """Every call names an offered tool and its arguments are a JSON object; for a forced call (made
    under the schemas' grammar) they validate against that tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in schemas, call.function.name
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
        if forced:
            jsonschema.validate(args, schemas[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("tools,question", TOOL_SETS, ids=[t[0]["function"]["name"] for t, _ in TOOL_SETS])
def test_required_gives_valid_calls(client, tools, question):
    # One call: the 135 M model, free to add calls, repeats them until max_tokens cuts the last one.
    r = ask(client, question, tools, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert len(check_calls(choice.message.tool_calls, tools)) == 1


@pytest.mark.parametrize("index", [2, 3, 4])
def test_named_function_gives_one_valid_call_of_it(client, index):
    tools, question = TOOL_SETS[index]
    name = tools[0]["function"]["name"]
    r = ask(client, question, tools, tool_choice={"type": "function", "function": {"name": name}})
    calls = check_calls(r.choices[0].message.tool_calls, tools)
    assert [n for n, _ in calls] == [name] and r.choices[0].finish_reason == "tool_calls"


def streamed_calls(client: openai.OpenAI, question: str, tools: list[dict], **kw):
    stream = ask(client, question, tools, stream=True, **kw)
    calls: dict[int, list[str]] = {}
    content, finish, named_first = "", None, True
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                named_first &= bool(d.id and d.function.name)
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert named_first
    return [tuple(calls[i]) for i in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_calls_equal_non_streamed(client, choice):
    tools, question = TOOL_SETS[2]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "book_flight"}}
    whole = ask(client, question, tools, tool_choice=tool_choice, parallel_tool_calls=False).choices[0]
    calls, content, finish = streamed_calls(client, question, tools, tool_choice=tool_choice,
                                            parallel_tool_calls=False)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == "" and finish == whole.finish_reason == "tool_calls"


def test_forced_calls_in_sync_scheduling_equal_async(client):
    # The grammar is applied in both step loops; greedy calls must come out the same.
    cases = [(TOOL_SETS[2], "required"), (TOOL_SETS[4], {"type": "function", "function": {"name": "order"}})]
    want = [ask(client, q, tools, tool_choice=choice, parallel_tool_calls=False).choices[0].message.tool_calls
            for (tools, q), choice in cases]
    srv = start_server(None, *SERVER_ARGS, "--no-async-scheduling")
    try:
        sync = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        for ((tools, q), choice), calls in zip(cases, want):
            got = ask(sync, q, tools, tool_choice=choice, parallel_tool_calls=False).choices[0].message.tool_calls
            check_calls(got, tools)
            assert [(c.function.name, c.function.arguments) for c in got] == \
                [(c.function.name, c.function.arguments) for c in calls]
    finally:
        stop_server(srv)


def test_parallel_tool_calls_false_makes_one_call(client):
    tools, question = TOOL_SETS[1]
    r = ask(client, question, tools, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(r.choices[0].message.tool_calls, tools)) == 1


def test_tool_result_round_trip(client):
    tools, question = TOOL_SETS[0]
    first = ask(client, question, tools, tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    result = "It is 18 degrees and sunny in Paris."
    messages = [{"role": "user", "content": question},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    r = client.chat.completions.create(model="smol", messages=messages, tools=tools, tool_choice="none",
                                       temperature=0.0, max_tokens=12)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    without = client.chat.completions.create(model="smol", messages=messages[:1], tools=tools, tool_choice="none",
                                             temperature=0.0, max_tokens=1)
    # The call and its result are in the prompt: it grew by at least the result's words.
    assert r.usage.prompt_tokens >= without.usage.prompt_tokens + len(result.split())


def test_none_gives_text_and_auto_never_fails(client):
    tools, question = TOOL_SETS[0]
    r = ask(client, question, tools, tool_choice="none", max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    for tools, question in TOOL_SETS[1:3]:
        # "auto", the default when tools are given: text or calls as the 135 M model likes (both seen).
        r = ask(client, question, tools, max_tokens=40)
        message = r.choices[0].message
        if message.tool_calls:
            check_calls(message.tool_calls, tools, forced=False)
            assert r.choices[0].finish_reason in ("tool_calls", "length")
        else:
            assert isinstance(message.content, str) and r.choices[0].finish_reason in ("stop", "length")
        calls, content, finish = streamed_calls(client, question, tools, max_tokens=40)
        assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert (content or None) == message.content and finish == r.choices[0].finish_reason


def test_reasoning_content_whole_and_streamed(client):
    # The regex makes the 135 M model think first, as a reasoning model would.
    extra = {"structured_outputs": {"regex": "<think>[a-z ]{4,24}</think>[A-Z][a-z ]{4,24}[.]"}}
    kw = dict(model="smol", messages=[{"role": "user", "content": "What colour is the sky?"}], temperature=0.0,
              max_tokens=40, extra_body=extra)
    message = client.chat.completions.create(**kw).choices[0].message
    assert re.fullmatch("[a-z ]{4,24}", message.reasoning_content), message
    assert re.fullmatch("[A-Z][a-z ]{4,24}[.]", message.content), message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_responses_api_text_tools_and_round_trip(client):
    question = "What is the weather in Paris in celsius?"
    text = client.responses.create(model="smol", input=question, max_output_tokens=8, temperature=0.0)
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}],
                                          max_tokens=8, temperature=0.0)
    assert text.output_text == chat.choices[0].message.content  # a thin layer over chat
    assert text.usage.input_tokens == chat.usage.prompt_tokens and text.status in ("completed", "incomplete")
    flat = [{"type": "function", **WEATHER["function"]}]
    r = client.responses.create(model="smol", input=question, tools=flat, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=MAX_TOKENS, temperature=0.0)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    turn = [{"role": "user", "content": question},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}]
    answer = client.responses.create(model="smol", input=turn, tools=flat, tool_choice="none", max_output_tokens=8,
                                     temperature=0.0)
    # The call and its output are in the prompt (the tools are not: tool_choice "none" leaves them out).
    assert answer.output_text and answer.usage.input_tokens >= text.usage.input_tokens + len(call.arguments) // 4
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="smol", input=question, previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


BAD_TOOLS = [
    ("schema with an unknown type", {"tools": [tool("f", "", {"x": {"type": "strng"}})], "tool_choice": "required"},
     "tools[0].function.parameters.properties.x.type"),
    ("parameters not an object schema",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type"),
    ("required not a list", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "x"}}}]}, "tools[0].function.parameters.required"),
    ("a schema the grammar backend refuses", {"tools": [tool("f", "", {"x": {"type": "string", "pattern": "(a"}})],
                                              "tool_choice": "required"}, "tools"),
    ("unknown named function", {"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    ("tool type not function", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ("bad function name", {"tools": [tool("no spaces", "", {})]}, "tools[0].function.name"),
    ("same name twice", {"tools": [NOW, NOW]}, "tools[1].function.name"),
    ("tool_choice not a choice", {"tools": [NOW], "tool_choice": "sometimes"}, "tool_choice"),
    ("forced call and response_format", {"tools": [NOW], "tool_choice": "required",
                                         "response_format": {"type": "json_object"}}, "tool_choice"),
    ("past call arguments not JSON", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "now", "arguments": "{oops"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]}, "messages[1].tool_calls[0].function.arguments"),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("name,extra,param", BAD_TOOLS, ids=[b[0] for b in BAD_TOOLS])
def test_bad_tools_payload_is_400_naming_the_field(server, name, extra, param):
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err
