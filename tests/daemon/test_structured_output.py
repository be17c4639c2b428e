"""Structured output and tool calling against a real server, through the unchanged client libraries
(the openai SDK's parse() helper, LangChain's ChatOpenAI): the 135M model's answers match the schemas
because the engine constrains its decoding, not because the model is good at JSON."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import API_KEY

pytestmark = pytest.mark.slow

LLM = "smollm2"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


# Bounded fields: the schema itself guarantees the answer fits the small max_tokens.
class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=16, description="the person's name")
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=16)
    unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "the time now",
                                              "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model=LLM, base_url=f"{server.base_url}/v1", api_key=API_KEY, temperature=0,
                                       max_tokens=64, max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_openai_parse_returns_the_pydantic_model(client):
    r = client.chat.completions.parse(model=LLM, messages=ask("Invent a person."), response_format=Person,
                                      temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    Person.model_validate_json(choice.message.content)


def test_json_object_mode_gives_a_json_object_even_unasked(client):
    r = client.chat.completions.create(model=LLM, messages=ask("Tell me about rivers."), temperature=0,
                                       max_tokens=64, response_format={"type": "json_object"})
    # Greedy, the 135M model closes its object at once here ("{}"), so the whole answer parses.
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_take_a_json_schema_too(client):
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    # The SDK's completions.create has no response_format argument: sent as an extra body field, as vLLM's users do.
    r = client.completions.create(model=LLM, prompt="Is water wet?", max_tokens=16, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_an_invalid_schema_is_400_naming_response_format(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=LLM, messages=ask("hi"), max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})
    assert err.value.body["param"] == "response_format"


def test_a_required_tool_call_matches_the_tool(client):
    r = client.chat.completions.create(model=LLM, messages=ask("What is the weather in Paris?"), temperature=0,
                                       max_tokens=64, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                                       # One call: the grammar then ends the turn, so the model cannot repeat
                                       # calls until max_tokens and the assertions below always run.
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_calls_stream_as_openai_does(client):
    stream = client.chat.completions.create(
        model=LLM, messages=ask("Weather in Oslo?"), temperature=0, max_tokens=64, stream=True,
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        logprobs=True, stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish = None
    logprobs = 0
    for chunk in stream:
        if not chunk.choices:  # the usage chunk
            usage = chunk.usage
            continue
        logprobs += len(chunk.choices[0].logprobs.content or []) if chunk.choices[0].logprobs else 0
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:  # accumulated by index, as clients do
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1  # named: exactly one call
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_TOOL["function"]["parameters"])
    # Each generated token's logprob is sent once, however the tool parser split or held back its text.
    assert logprobs == usage.completion_tokens > 0


def test_auto_and_none_and_a_tool_history_are_served(server, client):
    plain = client.chat.completions.create(model=LLM, messages=ask("Hello!"), max_tokens=16, temperature=0)
    # auto offers the tools (the prompt grows by their rendering) and decodes freely: to "Hello!" the
    # greedy 135M model answers in text, which stays text (what text, and whether it ends within 16 tokens,
    # is the model's: its prompt differs from the plain one).
    r = client.chat.completions.create(model=LLM, messages=ask("Hello!"), max_tokens=16, temperature=0,
                                       tools=[WEATHER_TOOL], tool_choice="auto")
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason == ("stop" if r.usage.completion_tokens < 16 else "length")
    # none offers no tools at all: the prompt is the plain one.
    r = client.chat.completions.create(model=LLM, messages=ask("Hello!"), max_tokens=16, temperature=0,
                                       tools=[WEATHER_TOOL], tool_choice="none", parallel_tool_calls=False)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == plain.choices[0].message.content
    question = ask("What is the weather in Oslo?")
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]
    asked = client.chat.completions.create(model=LLM, messages=question, max_tokens=1, temperature=0,
                                           tools=[WEATHER_TOOL], tool_choice="none")
    r = client.chat.completions.create(model=LLM, messages=history, max_tokens=16, temperature=0,
                                       tools=[WEATHER_TOOL], tool_choice="none")
    # The call and its result are rendered into the prompt (more than the call's and result's own words).
    assert r.usage.prompt_tokens >= asked.usage.prompt_tokens + 12, (r.usage, asked.usage)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


def test_client_default_no_op_values_are_accepted(server):
    body = {"model": LLM, "messages": ask("Hi"), "max_tokens": 2, "parallel_tool_calls": False, "logit_bias": {},
            "response_format": {"type": "text"}}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    person = chat_model.with_structured_output(Person, method=method).invoke("Invent a person.")
    assert isinstance(person, Person)


def test_langchain_json_mode(chat_model):
    schema = {"title": "Answer", "description": "an answer", "type": "object",
              "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
    answer = chat_model.with_structured_output(schema, method="json_mode").invoke(
        'Reply with the JSON object {"yes": true} or {"yes": false}. Is the sky blue?')
    assert isinstance(answer, dict)  # json_mode promises a JSON object, not the schema


def test_langchain_bind_tools(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = chat_model.bind_tools([GetWeather], tool_choice="GetWeather")
    question = HumanMessage("What is the weather in Rome?")
    ai = bound.invoke([question])
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "GetWeather"
    GetWeather.model_validate(ai.tool_calls[0]["args"])
    # The next turn sends the call and its result back, as an agent loop does.
    result = ToolMessage("Sunny, 25 degrees.", tool_call_id=ai.tool_calls[0]["id"])
    # tool_choice none: the turn after the result is text, whatever the model would choose.
    final = chat_model.bind_tools([GetWeather], tool_choice="none").invoke([question, ai, result])
    assert final.content and not final.tool_calls
    # The call and its result went back in the prompt.
    assert final.usage_metadata["input_tokens"] > chat_model.invoke([question]).usage_metadata["input_tokens"] + 10
