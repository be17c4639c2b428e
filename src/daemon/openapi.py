"""GET /openapi.json: the API described from the definitions that validate it.

Request bodies come from the pydantic models in ``openai_schemas`` and ``headrace_schemas``
(the routes validate with the same classes) and each workflow's run body from
``Workflow.schema()`` (the schema its validator applies), so the document is never written twice.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from headrace import __version__
from headrace.daemon import headrace_schemas as h
from headrace.daemon import openai_schemas as o
from headrace.daemon import responses_schemas as r
from headrace.daemon.services import services
from headrace.graph.workflow import Workflow

REF = "#/components/schemas/{model}"
JSON = "application/json"
SSE = "text/event-stream"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict[str, Any], description: str = "OK", *, stream: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {JSON: {"schema": schema}}
    if stream:
        content[SSE] = {"schema": {"type": "string", "description": "server-sent events (with stream: true)"}}
    return {"description": description, "content": content}


ERRORS = {
    "4XX": _json(_ref(o.ErrorResponse), "the client erred; OpenAI's error envelope"),
    "5XX": _json(_ref(o.ErrorResponse), "the server failed or is not ready; OpenAI's error envelope"),
}
RUN_ID = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _query(model: type[BaseModel]) -> list[dict[str, Any]]:
    """A query model's fields as OpenAPI query parameters (the route validates with the same model)."""
    schema = model.model_json_schema()
    return [{"name": name, "in": "query", "required": name in schema.get("required", ()), "schema": prop}
            for name, prop in schema["properties"].items()]
COLLECTION = {"name": "collection", "in": "path", "required": True,
              "schema": {"type": "string", "pattern": h.COLLECTION_NAME}}
ENGINE_NAME = {"name": "engine", "in": "path", "required": True, "schema": {"type": "string"}}
MODEL_ID = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
ASSET = {"name": "file", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "a file of the swagger-ui-bundle package"}
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
VARIABLE = {"name": "variable", "in": "path", "required": True,
            "schema": {"type": "string", "pattern": h.VARIABLE_NAME}}
DOCUMENT_ID = {"name": "document_id", "in": "path", "required": True, "schema": {"type": "string"},
               "description": "may hold '/' (an ingested file's relative path)"}


def _op(summary: str, ok: dict[str, dict[str, Any]], body: dict[str, Any] | None = None, *,
        params: list[dict[str, Any]] = (), guarded: bool = True, keyed: bool | None = None) -> dict[str, Any]:
    """An operation; ``guarded``: it may answer errors; ``keyed`` (default: as guarded): it needs the API key."""
    op: dict[str, Any] = {"summary": summary, "responses": {**ok, **(ERRORS if guarded else {})}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {JSON: {"schema": body}}}
    if params:
        op["parameters"] = list(params)
    if not (guarded if keyed is None else keyed):
        op["security"] = []
    return op


def document(workflows: Mapping[str, Workflow]) -> dict[str, Any]:
    requests = [o.ChatCompletionRequest, o.CompletionRequest, o.EmbeddingRequest, o.RerankRequest, h.RunRequest,
                h.CreateCollectionRequest, h.AddDocumentsRequest, h.EngineSettingsRequest, o.TokenizeRequest,
                o.TokenizeChatRequest, o.DetokenizeRequest, h.CreateSessionRequest, h.CreateVariableRequest,
                h.SetVariableRequest, h.SemanticCallRequest, r.ResponseRequest]
    responses = [o.ErrorResponse, h.Health, h.Readiness, o.ModelCard, o.ModelList, o.ChatCompletion, o.Completion,
                 o.EmbeddingList, o.RerankResponse, h.WorkflowList, h.RunRecord, h.RunList, h.RunGraph, h.RunTimeline,
                 h.CollectionCard, h.CollectionList, h.DocumentsAdded, h.Deleted, h.EngineSettings, o.Tokenized,
                 o.Detokenized, h.SessionCard, h.SessionVariable, h.SessionCall, r.ResponseObject, r.ResponseDeleted,
                 r.InputItemList]
    _, defs = models_json_schema([(m, "validation") for m in requests + responses], ref_template=REF)
    components = dict(defs.get("$defs", {}))
    text = {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths: dict[str, Any] = {
        "/health": {"get": _op("liveness", {"200": _json(_ref(h.Health))}, guarded=False)},
        "/ready": {"get": _op("readiness: 200 once every engine is loaded, else 503",
                              {"200": _json(_ref(h.Readiness)), "503": _json(_ref(h.Readiness), "not ready")},
                              guarded=False)},
        "/metrics": {"get": _op("Prometheus metrics", {"200": text}, guarded=False)},
        "/openapi.json": {"get": _op("this document", {"200": _json({"type": "object"})}, guarded=False)},
        "/docs": {"get": _op("Swagger UI over this document", {"200": {
            "description": "OK", "content": {"text/html": {"schema": {"type": "string"}}}}}, guarded=False)},
        "/docs/assets/{file}": {"get": _op("a static file of the /docs page", {"200": {
            "description": "OK", "content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}}},
            params=[ASSET], keyed=False)},
        "/tokenize": {"post": _op("tokenize a prompt, or chat messages through the chat template (vLLM's)",
                                  {"200": _json(_ref(o.Tokenized))},
                                  {"oneOf": [_ref(o.TokenizeRequest), _ref(o.TokenizeChatRequest)]}, keyed=False)},
        "/detokenize": {"post": _op("token ids back to text (vLLM's)", {"200": _json(_ref(o.Detokenized))},
                                    _ref(o.DetokenizeRequest), keyed=False)},
        "/v1/models": {"get": _op("the engines", {"200": _json(_ref(o.ModelList))})},
        "/v1/models/{model}": {"get": _op("one engine", {"200": _json(_ref(o.ModelCard))}, params=[MODEL_ID])},
        "/v1/chat/completions": {"post": _op("chat completion", {"200": _json(_ref(o.ChatCompletion), stream=True)},
                                             _ref(o.ChatCompletionRequest))},
        "/v1/completions": {"post": _op("text completion", {"200": _json(_ref(o.Completion), stream=True)},
                                        _ref(o.CompletionRequest))},
        "/v1/responses": {"post": _op(
            "create a response (OpenAI's Responses API, served as a chat request); stored unless store: false",
            {"200": _json(_ref(r.ResponseObject), stream=True)}, _ref(r.ResponseRequest))},
        "/v1/responses/{response_id}": {
            "get": _op("a stored response (404: missing, expired, or another key's)",
                       {"200": _json(_ref(r.ResponseObject))}, params=[RESPONSE_ID]),
            "delete": _op("delete a stored response", {"200": _json(_ref(r.ResponseDeleted))}, params=[RESPONSE_ID]),
        },
        "/v1/responses/{response_id}/input_items": {"get": _op(
            "a stored response's input items, a page at a time", {"200": _json(_ref(r.InputItemList))},
            params=[RESPONSE_ID, *_query(r.InputItemsQuery)])},
        "/v1/embeddings": {"post": _op("embeddings", {"200": _json(_ref(o.EmbeddingList))},
                                       _ref(o.EmbeddingRequest))},
        "/v1/rerank": {"post": _op("rerank documents against a query", {"200": _json(_ref(o.RerankResponse))},
                                   _ref(o.RerankRequest))},
        "/v1/collections": {
            "get": _op("the caller's collections and the public ones, with document and chunk counts",
                       {"200": _json(_ref(h.CollectionList))}),
            "post": _op("create a collection owned by the caller's API key (409 if the name is taken)", {"200": _json(_ref(h.CollectionCard))},
                        _ref(h.CreateCollectionRequest)),
        },
        "/v1/collections/{collection}": {
            "get": _op("a collection", {"200": _json(_ref(h.CollectionCard))}, params=[COLLECTION]),
            "delete": _op("delete a collection and its chunks (403 on a public one while keys are configured)", {"200": _json(_ref(h.Deleted))},
                          params=[COLLECTION]),
        },
        "/v1/collections/{collection}/documents": {"post": _op(
            "chunk, embed and index documents; re-posting an id replaces that document",
            {"200": _json(_ref(h.DocumentsAdded))}, _ref(h.AddDocumentsRequest), params=[COLLECTION])},
        "/v1/collections/{collection}/documents/{document_id}": {"delete": _op(
            "delete a document's chunks", {"200": _json(_ref(h.Deleted))}, params=[COLLECTION, DOCUMENT_ID])},
        "/v1/engines/{engine}": {"patch": _op(
            "change a live engine's settings: an LLM's scheduling policy, its prefix caching",
            {"200": _json(_ref(h.EngineSettings))}, _ref(h.EngineSettingsRequest), params=[ENGINE_NAME])},
        "/v1/sessions": {"post": _op("open a semantic-variable session, owned by the caller's API key",
                                     {"200": _json(_ref(h.SessionCard))}, _ref(h.CreateSessionRequest))},
        "/v1/sessions/{session_id}": {
            "get": _op("a session: its variables and calls", {"200": _json(_ref(h.SessionCard))},
                       params=[SESSION_ID]),
            "delete": _op("close a session, cancelling its work", {"200": _json(_ref(h.Deleted))},
                          params=[SESSION_ID]),
        },
        "/v1/sessions/{session_id}/variables": {"post": _op(
            "create a semantic variable (409 if the name is taken)", {"200": _json(_ref(h.SessionVariable))},
            _ref(h.CreateVariableRequest), params=[SESSION_ID])},
        "/v1/sessions/{session_id}/variables/{variable}": {
            "get": _op("a variable's value, waiting until it is ready (408 after timeout; 424 if its producer "
                       "failed)", {"200": _json(_ref(h.SessionVariable))},
                       params=[SESSION_ID, VARIABLE, *_query(h.VariableQuery)]),
            "put": _op("set a variable's content (once; 409 after)", {"200": _json(_ref(h.SessionVariable))},
                       _ref(h.SetVariableRequest), params=[SESSION_ID, VARIABLE]),
        },
        "/v1/sessions/{session_id}/calls": {"post": _op(
            "submit a semantic call: it runs server-side once its inputs are set", {"200": _json(_ref(h.SessionCall))},
            _ref(h.SemanticCallRequest), params=[SESSION_ID])},
        "/v1/workflows": {"get": _op("the workflows and their schemas", {"200": _json(_ref(h.WorkflowList))})},
        "/v1/runs": {"get": _op("the caller's own runs, newest first, a page at a time",
                                {"200": _json(_ref(h.RunList))}, params=_query(h.RunListQuery))},
        "/v1/runs/{run_id}": {
            "get": _op("a run's record", {"200": _json(_ref(h.RunRecord))}, params=[RUN_ID]),
            "delete": _op("cancel a run", {"200": _json(_ref(h.RunRecord))}, params=[RUN_ID]),
        },
        "/v1/runs/{run_id}/events": {"get": _op(
            "follow a run's events (SSE), from the oldest held or after Last-Event-ID; reading never cancels the run "
            "(410: an old run kept as a summary only)",
            {"200": {"description": "server-sent events: node and run states, streamed deltas, and events.dropped "
                                    "when the reader fell behind", "content": {SSE: {"schema": {"type": "string"}}}}},
            params=[RUN_ID, *_query(h.RunEventsQuery)])},
        "/v1/runs/{run_id}/graph": {"get": _op("a run's e-graph (JSON, or Graphviz with ?format=dot; 410: an old "
                                               "run kept as a summary only)",
                                               {"200": _json(_ref(h.RunGraph))}, params=[RUN_ID])},
        "/v1/runs/{run_id}/timeline": {"get": _op("a run's primitives and engine batches",
                                                  {"200": _json(_ref(h.RunTimeline))}, params=[RUN_ID])},
        "/v1/runs/{run_id}/timeline.png": {"get": _op("a run's timeline drawn", {"200": {
            "description": "OK", "content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}}},
            params=[RUN_ID])},
    }
    for name, workflow in workflows.items():
        body = copy.deepcopy(components["RunRequest"])
        schema = workflow.schema()
        body["properties"]["inputs"] = schema["inputs"]
        body["properties"]["config"] = schema["config"]
        body["title"] = f"RunRequest[{name}]"
        components[f"RunRequest_{name}"] = body
        paths[f"/v1/workflows/{name}/runs"] = {"post": _op(
            f"run {name}: {workflow.description}",
            {"200": _json(_ref(h.RunRecord), "the finished run", stream=True),
             "202": {**_json(_ref(h.RunRecord), "the run, started in the background"),
                     "headers": {"Location": {"description": "the run's URL, /v1/runs/{id}",
                                              "schema": {"type": "string"}}}}},
            {"$ref": REF.format(model=f"RunRequest_{name}")})}
    return {
        "openapi": "3.1.0",
        "info": {"title": "headrace", "version": __version__,
                 "description": "A serving daemon for compound-AI workflows: OpenAI-compatible routes and "
                                "workflow runs."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


async def openapi_json(request: Request) -> Response:
    state = services(request)
    if state.openapi is None:  # the workflows are fixed once the app exists
        state.openapi = document(state.daemon.workflows.workflows)
    return JSONResponse(state.openapi)
