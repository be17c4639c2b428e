"""Structured output and tools, without a model: request checks, constraint grammars, tool-call parsing."""

from __future__ import annotations

import json

import pytest

from headrace.daemon import openai_schemas as schemas, structured
from headrace.daemon.errors import APIError
from headrace.daemon.bodies import parse_json, validate
from headrace.plugins.engines.llm.chat import format_tool_call
from headrace.plugins.protocols import LarkConstraint

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = frozenset({"get_weather", "get_time"})


def chat(**extra) -> schemas.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return validate(schemas.ChatCompletionRequest, parse_json(json.dumps(body).encode()))


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args)
    assert err.value.status == 400
    return err.value


def test_client_defaults_are_accepted():
    body = chat(parallel_tool_calls=False, logit_bias={}, response_format={"type": "text"}, tool_choice="none")
    assert structured.plan_tools(body) is None and structured.response_constraint(body) is None


def test_a_logit_bias_key_that_is_not_a_token_id_is_refused_by_name():
    assert chat(logit_bias={"42": 5.0}).logit_bias == {"42": 5.0}
    with pytest.raises(APIError) as err:
        chat(logit_bias={"cat": 5.0})
    assert err.value.param.startswith("logit_bias") and err.value.code == "invalid_value"


def test_response_formats_become_json_schema_constraints():
    assert json.loads(structured.response_constraint(chat(response_format={"type": "json_object"})).schema) == \
        {"type": "object"}
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    constraint = structured.response_constraint(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    assert list(json.loads(constraint.schema)["properties"]) == ["b", "a"]  # the order the output is written in


@pytest.mark.parametrize("schema", [{"type": "no-such-type"}, {"type": "object", "properties": {"a": {"$ref": "#/x"}}}])
def test_a_schema_that_cannot_be_enforced_is_400_naming_response_format(schema):
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert refused(structured.response_constraint, body).param == "response_format"


def test_tool_choice_is_checked_against_the_tools():
    assert refused(structured.plan_tools, chat(tool_choice="required")).param == "tool_choice"
    named = {"type": "function", "function": {"name": "nope"}}
    assert refused(structured.plan_tools, chat(tools=[WEATHER], tool_choice=named)).param == "tool_choice"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    assert refused(structured.plan_tools, chat(tools=[WEATHER, bad], tool_choice="required")).param == \
        "tools[1].function.parameters"
    assert refused(structured.plan_tools, chat(tools=[WEATHER, WEATHER])).param == "tools"


def test_auto_offers_the_tools_without_a_constraint_and_none_offers_nothing():
    plan = structured.plan_tools(chat(tools=[WEATHER, TIME]))
    assert plan.constraint is None and plan.names == NAMES and plan.specs[0] == WEATHER
    assert structured.plan_tools(chat(tools=[WEATHER], tool_choice="none")) is None


@pytest.mark.parametrize("choice, parallel, repeat", [
    ("required", None, True), ("required", False, False),
    ({"type": "function", "function": {"name": "get_time"}}, None, False),
])
def test_required_and_named_choices_constrain_to_calls(choice, parallel, repeat):
    plan = structured.plan_tools(chat(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel))
    assert isinstance(plan.constraint, LarkConstraint)
    assert ('("\\n" call)*' in plan.constraint.grammar) == repeat
    assert ("get_weather" in plan.constraint.grammar) == (choice == "required")


def test_a_tool_with_defs_keeps_its_references_resolvable():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}}
    plan = structured.plan_tools(chat(tools=[tool], tool_choice="required"))  # compiles: no 400
    assert '"$defs"' in plan.constraint.grammar


def test_a_whole_output_of_calls_parses_into_tool_calls():
    text = format_tool_call("get_weather", {"city": "Paris"}) + "\n" + format_tool_call("get_time", {})
    content, calls = structured.parse_tool_output(text, NAMES)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "Paris is sunny.", "<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{not json\n</tool_call>", "<tool_call>\n{\"name\": \"get_time\", \"argu",  # cut off
    "  <tool", "Say <tool_call> later",
])
def test_text_that_is_not_a_call_is_content(text):
    content, calls = structured.parse_tool_output(text, NAMES)
    assert calls == [] and content == text


def test_the_stream_parser_sends_content_at_once_and_each_call_when_its_block_closes():
    parser = structured.ToolCallParser(NAMES)
    assert parser.feed("Hel") == [("content", "Hel")] and parser.feed("lo") == [("content", "lo")]
    parser = structured.ToolCallParser(NAMES)
    text = format_tool_call("get_time", {}) + "\n" + format_tool_call("get_weather", {"city": "Oslo"})
    items = [item for ch in text for item in parser.feed(ch)]
    assert [kind for kind, _ in items] == ["call", "call"]
    assert parser.finish() == []
    first_close = text.index("</tool_call>") + len("</tool_call>")
    parser = structured.ToolCallParser(NAMES)
    assert parser.feed(text[: first_close - 1]) == []
    assert [kind for kind, _ in parser.feed(text[first_close - 1 : first_close])] == ["call"]


def test_history_with_tool_calls_and_results_converts_to_the_template_format():
    body = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ])
    messages = structured.chat_messages(body)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message, param", [
    ({"role": "user"}, "messages[0].content"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f", "arguments": "{oops"}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_malformed_history_is_400_naming_the_field(message, param):
    assert refused(structured.chat_messages, chat(messages=[message])).param == param
