"""A chat request's tools without a server: the checks, the forced-call grammar, the prompt without tool support."""

from __future__ import annotations

import json

import pytest

from forerun.entrypoints.openai.protocol import ChatCompletionRequest
from forerun.entrypoints.openai.tool_prompt import template_inputs
from forerun.entrypoints.openai.tool_request import ChatParsing, plan_tools

AUTO = ChatParsing("hermes", True)
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def fn(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


def accepts(schema: dict, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


def test_required_grammar_holds_every_tool_and_renames_defs():
    # Both tools name `#/$defs/p` for different schemas: inside one array they must not collide.
    a = {"type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"], "$defs": {"p": POINT}}
    b = {"type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"],
         "$defs": {"p": {"type": "string", "enum": ["on", "off"]}}}
    plan = plan_tools(request(tools=[fn("a", a), fn("b", b)], tool_choice="required"), AUTO)
    schema = plan.constraint()
    assert accepts(schema, '[{"name": "a", "parameters": {"p": {"x": 1, "y": 2}}}, '
                           '{"name": "b", "parameters": {"p": "on"}}]')
    assert not accepts(schema, '[{"name": "b", "parameters": {"p": {"x": 1, "y": 2}}}]')  # b's own p
    assert not accepts(schema, '[{"name": "c", "parameters": {}}]') and not accepts(schema, "[]")
    single = plan_tools(request(tools=[fn("a", a), fn("b", b)], tool_choice="required", parallel_tool_calls=False),
                        AUTO).constraint()
    assert not accepts(single, '[{"name": "b", "parameters": {"p": "on"}}, {"name": "b", "parameters": {"p": "on"}}]')


def test_named_grammar_is_the_function_parameters():
    plan = plan_tools(request(tools=[fn("a", POINT), fn("b")], tool_choice={"type": "function",
                                                                              "function": {"name": "b"}}), AUTO)
    assert plan.mode == "named" and plan.constraint() == {"type": "object", "properties": {}}
    assert plan_tools(request(tools=[fn("a", POINT)], tool_choice={"type": "function", "function": {"name": "a"}}),
                      AUTO).constraint() == POINT


@pytest.mark.parametrize("kw,parsing,field", [
    ({"tools": [fn("a")]}, ChatParsing(), "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ({"tool_choice": "auto"}, AUTO, "tool_choice"),
    ({"tools": [fn("a", {"type": "object", "properties": {"x": {"enum": []}}})]}, AUTO,
     "tools[0].function.parameters.properties.x.enum"),
    ({"tools": [fn("a", {"type": "object", "properties": {"x": {"maxLength": -1}}})]}, AUTO,
     "tools[0].function.parameters.properties.x.maxLength"),
    ({"tools": [fn("a", {"type": "object", "anyOf": {}})]}, AUTO, "tools[0].function.parameters.anyOf"),
    ({"tools": [fn("a"), fn("a")]}, AUTO, "tools[1].function.name"),
    ({"tools": [fn("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}}, AUTO,
     "tool_choice.function.name"),
    ({"tools": [fn("a")], "tool_choice": {"type": "function"}}, AUTO, "tool_choice"),
    ({"tools": [fn("a")], "tool_choice": "required", "structured_outputs": {"regex": "a"}}, AUTO, "tool_choice"),
])
def test_bad_tools_name_the_field(kw, parsing, field):
    with pytest.raises(ValueError) as err:
        plan_tools(request(**kw), parsing)
    assert str(err.value).startswith(field + ":"), err.value


def test_server_options_are_checked():
    with pytest.raises(ValueError, match="^tool_call_parser:"):
        ChatParsing("hermes2")
    with pytest.raises(ValueError, match="^enable_auto_tool_choice:"):
        ChatParsing(None, True)
    with pytest.raises(ValueError, match="^reasoning_parser:"):
        ChatParsing(reasoning_parser="o1")


def test_none_leaves_tools_out_of_the_prompt():
    plan = plan_tools(request(tools=[fn("a")], tool_choice="none"), ChatParsing())
    assert plan.mode == "none" and plan.prompt_tools is None and plan.constraint() is None


def test_prompt_without_tool_support_spells_out_hermes():
    tools = [fn("get_weather", POINT)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"x": 1, "y": 2}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out, shown = template_inputs(messages, tools, template_takes_tools=False)
    assert shown is None and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and json.dumps(tools[0]) in out[0]["content"]
    assert "<tool_call>" in out[0]["content"] and "</tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    same, given = template_inputs(messages, tools, template_takes_tools=True)
    assert same is messages and given is tools


def test_tokenizer_tells_a_template_that_reads_tools(tmp_path, smollm2_dir):
    from forerun.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(smollm2_dir)
    assert not tok.chat_template_takes_tools()  # SmolLM2's template has no tool support
    with_tools = Tokenizer(tok._tok, chat_template="{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")
    assert with_tools.chat_template_takes_tools()
    assert with_tools.apply_chat_template([{"role": "user", "content": "x"}], tools=[fn("f")]) == "f"
