"""POST /v1/responses against the real model through the session's daemon: the response object, stored
responses (owned by their key, surviving a restart), a continued response served as its predecessor's
program, cut tool calls, and bad input. The openai SDK drives it unchanged where it can."""

from __future__ import annotations

import json
import sqlite3
import time

import anyio

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from conftest import API_KEY, OTHER_API_KEY
from headrace.daemon.app import create_app, principal
from headrace.daemon.config import ConfigError, load_config
from headrace.daemon.responses_store import ResponsesStore
from headrace.plugins.engines.kvreuse.prefix_cache import BLOCK

pytestmark = pytest.mark.slow

LLM = "smollm2"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
OTHER = {"Authorization": f"Bearer {OTHER_API_KEY}"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
FORCED = {"type": "function", "name": "get_weather"}


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**8)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def post(server, body: dict, headers: dict = HEADERS) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/responses", json={"model": LLM, **body}, headers=headers, timeout=120)


def stored_rows(server) -> int:
    store = server.app.state.services.responses
    with sqlite3.connect(store.path) as db:
        return db.execute("SELECT count(*) FROM responses").fetchone()[0]


def test_a_text_response_is_stored_listed_and_deleted(server, client):
    r = client.responses.create(model=LLM, input="Say hello.", instructions="Be brief.", max_output_tokens=8,
                                temperature=0, metadata={"case": "text"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"] and r.output_text
    assert r.output[0].content[0].type == "output_text" and r.metadata == {"case": "text"}
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.usage == r.usage
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hello.")]
    # Another key's response is as unknown as a missing one.
    assert httpx.get(f"{server.base_url}/v1/responses/{r.id}", headers=OTHER).status_code == 404
    assert httpx.delete(f"{server.base_url}/v1/responses/{r.id}", headers=OTHER).status_code == 404
    deleted = client.responses.delete(r.id)
    assert deleted is None  # the SDK returns nothing for a 200
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r.id)
    assert err.value.body["code"] == "response_not_found"
    # store: false keeps nothing.
    unstored = client.responses.create(model=LLM, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_continued_response_finds_its_earlier_tokens_in_the_cache(server, client):
    first = client.responses.create(model=LLM, input="Name a colour.", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=LLM, input="And another one?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # The conversation was rebuilt server-side: the first turn's input and output are in this prompt ...
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # ... and were found in the prefix cache, not prefilled again (as the engine counted them; the cache holds
    # whole blocks of BLOCK tokens): more than the first turn found of what other requests left there.
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // BLOCK * BLOCK
    assert cached > first.usage.input_tokens_details.cached_tokens
    assert second.previous_response_id == first.id
    # One program: both turns counted to the chain's program (headrace.batching.programs).
    registry = server.app.state.services.programs
    chains = [p for p in registry._programs if p.endswith(f"/response:{first.id}")]
    assert len(chains) == 1 and registry.attained(chains[0]) > 0


def test_a_forced_function_call_and_its_output_continue_the_conversation(server, client):
    r = client.responses.create(model=LLM, input="What is the weather in Oslo?", tools=[WEATHER], tool_choice=FORCED,
                                max_output_tokens=48, temperature=0)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The client runs the tool and sends only its output: the call is found in the stored conversation.
    after = client.responses.create(model=LLM, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "Sunny, 21 degrees."}], max_output_tokens=8, temperature=0)
    assert after.output[0].type == "message" and after.usage.input_tokens_details.cached_tokens > 0


def test_a_cut_function_call_is_an_incomplete_function_call(client):
    r = client.responses.create(model=LLM, input="What is the weather in Oslo?", tools=[WEATHER], tool_choice=FORCED,
                                max_output_tokens=21, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["function_call"], r.output
    call = r.output[0]
    assert call.status == "incomplete" and call.name == "get_weather"
    assert "<tool_call>" not in call.arguments and '"city"' in call.arguments  # the arguments so far


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_chat_tool_call_is_a_tool_call_with_finish_length(client, stream):
    body = dict(model=LLM, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=21, temperature=0,
                tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}],
                tool_choice="required")
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        finish, content, calls = choice.finish_reason, choice.message.content, choice.message.tool_calls
        name, arguments = calls[0].function.name, calls[0].function.arguments
    else:
        name = arguments = content = ""
        finish = None
        for chunk in client.chat.completions.create(**body, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and not content and name == "get_weather"
    assert arguments.startswith('{"city": "') and "tool_call" not in arguments


def test_the_stream_sends_the_documented_events(client):
    # A bounded JSON answer (text.format), so the 135M model's reply completes: the SDK wants response.completed.
    answer = {"type": "json_schema", "name": "answer", "strict": True, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}
    with client.responses.stream(model=LLM, input="Is water wet?", text={"format": answer}, max_output_tokens=16,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{final.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.status == "completed" and isinstance(json.loads(text)["ok"], bool)
    assert client.responses.retrieve(final.id).output_text == text  # stored before completed was sent

    with client.responses.stream(model=LLM, input="Weather in Rome?", tools=[WEATHER], tool_choice=FORCED,
                                 max_output_tokens=48, temperature=0) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])


def test_parse_returns_the_pydantic_model(client):
    r = client.responses.parse(model=LLM, input="Invent a city.", text_format=City, max_output_tokens=48,
                               temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, City)


def test_bad_input_is_a_named_4xx_and_stores_nothing(server):
    before = stored_rows(server)
    r = post(server, {"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    mine = post(server, {"input": "hi", "max_output_tokens": 1}).json()["id"]
    r = post(server, {"input": "hi", "previous_response_id": mine}, headers=OTHER)  # another key's
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    r = post(server, {"input": [{"role": "user", "content": "hi"},
                                {"type": "function_call_output", "call_id": "call_x", "output": "42"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].call_id"
    r = post(server, {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "no-type"}}],
                      "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters"
    r = post(server, {"input": "hi", "tools": [{"type": "function", "name": "bad name"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].name"
    r = post(server, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a",
                                                         "schema": {"type": "no-type"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    r = post(server, {"input": "hi", "background": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    assert stored_rows(server) == before + 1  # only the good one


def test_the_sampling_fields_reach_the_engine(server):
    # The greedy first token, banned by logit_bias: the answer changes only if the field reached the engine.
    body = {"input": "The capital of France is", "max_output_tokens": 1, "temperature": 0, "store": False}
    greedy = post(server, body).json()["output"][0]["content"][0]["text"]
    first = httpx.post(f"{server.base_url}/tokenize", headers=HEADERS, timeout=60, json={
        "model": LLM, "prompt": greedy, "add_special_tokens": False}).json()["tokens"][0]
    banned = post(server, {**body, "logit_bias": {str(first): -100}, "top_k": 5, "presence_penalty": 0.5})
    assert banned.status_code == 200, banned.text
    assert banned.json()["output"][0]["content"][0]["text"] != greedy
    # Checked as chat checks them, named as the client sent them.
    r = post(server, {**body, "stop_token_ids": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids[0]"
    r = post(server, {**body, "min_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "'max_output_tokens'" in r.json()["error"]["message"]


def test_stored_responses_survive_a_restart_and_expire(server, tmp_path):
    r = post(server, {"input": "Hello", "max_output_tokens": 2}).json()
    data = server.app.state.services.responses.path.parent
    # Another daemon on the same data dir (no engines needed to read the store): the one restarted.
    config = load_config(None, overrides={"data.dir": str(data), "server.api_key": API_KEY})
    with TestClient(create_app(config)) as restarted:
        got = restarted.get(f"/v1/responses/{r['id']}", headers=HEADERS)
        assert got.status_code == 200 and got.json() == r
        items = restarted.get(f"/v1/responses/{r['id']}/input_items?order=asc&limit=1", headers=HEADERS).json()
        assert items["data"][0]["content"][0]["text"] == "Hello" and items["has_more"] is False
    # Past max_age_seconds it is gone (read as the daemon would a minute later).
    kept = anyio.run(ResponsesStore(data, max_age_seconds=60).get, r["id"])
    assert kept is not None and kept.owner == principal(API_KEY)
    later = ResponsesStore(data, max_age_seconds=60, clock=lambda: time.time() + 61)
    assert anyio.run(later.get, r["id"]) is None


def test_a_bad_responses_setting_is_a_named_config_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[responses]\nmax_age = 60\n")
    with pytest.raises(ConfigError, match=r"responses\.max_age: unknown key; did you mean 'max_age_seconds'"):
        load_config(bad)
    bad.write_text("[responses]\nmax_age_seconds = 0\n")
    with pytest.raises(ConfigError, match=r"responses\.max_age_seconds: must be > 0"):
        load_config(bad)
