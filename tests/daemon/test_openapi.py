"""/openapi.json is generated from the definitions that validate requests (no models loaded)."""

from __future__ import annotations

import re

import httpx
import pytest
from starlette.routing import Route

from headrace.daemon import openai_schemas as schemas
from headrace.daemon.app import create_app
from headrace.daemon.config import Config
from headrace.daemon.openapi import REF
from headrace.daemon.bodies import parse_json, validate
from headrace.daemon.errors import APIError


@pytest.fixture(scope="module")
def app():
    return create_app(Config())


@pytest.fixture(scope="module")
def doc(app):
    async def get():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.get("/openapi.json")
            assert r.status_code == 200
            return r.json()

    import anyio

    return anyio.run(get)


def test_every_route_is_described(app, doc):
    assert doc["openapi"].startswith("3.1")
    workflows = app.state.services.daemon.workflows.workflows
    for route in app.routes:
        assert isinstance(route, Route)
        methods = {m.lower() for m in route.methods or ()} - {"head"}
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # {document_id:path} is {document_id} in OpenAPI
        paths = [f"/v1/workflows/{name}/runs" for name in workflows] if "{name}" in path else [path]
        for path in paths:
            assert methods <= set(doc["paths"][path]), (path, methods)


def test_request_bodies_are_the_validating_models(doc):
    components = doc["components"]["schemas"]
    for model in (schemas.ChatCompletionRequest, schemas.CompletionRequest, schemas.EmbeddingRequest,
                  schemas.RerankRequest, schemas.TokenizeRequest, schemas.TokenizeChatRequest,
                  schemas.DetokenizeRequest):
        published = components[model.__name__]
        generated = model.model_json_schema(ref_template=REF)
        generated.pop("$defs", None)
        assert published == generated
        assert published["additionalProperties"] is False
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": REF.format(model="ChatCompletionRequest")}
    body = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"oneOf": [{"$ref": REF.format(model=m)} for m in ("TokenizeRequest", "TokenizeChatRequest")]}


def test_each_workflow_run_body_is_its_schema(app, doc):
    for name, workflow in app.state.services.daemon.workflows.workflows.items():
        op = doc["paths"][f"/v1/workflows/{name}/runs"]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert body["properties"]["inputs"] == workflow.schema()["inputs"]
        assert body["properties"]["config"] == workflow.schema()["config"]
        assert body["additionalProperties"] is False
        assert {"200", "202", "4XX"} <= set(op["responses"])


def test_every_integer_in_a_workflow_config_is_bounded(app):
    def integers(schema, path):
        if schema.get("type") == "integer":
            yield path, schema
        for key, sub in schema.get("properties", {}).items():
            yield from integers(sub, f"{path}.{key}")

    for workflow in app.state.services.daemon.workflows.workflows.values():
        for path, schema in integers(workflow.schema()["config"], "config"):
            assert "maximum" in schema and "minimum" in schema, (workflow.name, path)


@pytest.mark.parametrize("raw, param, code", [
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 0}', "n", "invalid_value"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": []}', "tools", "invalid_value"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content", "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "model", "missing_required_parameter"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}', "seed",
     "invalid_value"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": true}', "temperature",
     "invalid_value"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content",
     "invalid_value"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}', None, "invalid_json"),
    (b"[" * 5000 + b"]" * 5000, None, "invalid_json"),
])
def test_chat_body_errors_name_the_field(raw, param, code):
    with pytest.raises(APIError) as err:
        validate(schemas.ChatCompletionRequest, parse_json(raw))
    assert err.value.status == 400 and err.value.param == param and err.value.code == code


def test_neutral_values_are_accepted():
    body = validate(schemas.ChatCompletionRequest, parse_json(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1, "presence_penalty": 0,'
        b' "frequency_penalty": 0.0, "logprobs": false, "parallel_tool_calls": null, "stop": ""}'))
    assert body.n == 1
