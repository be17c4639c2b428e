"""OpenAI-style retrieval routes: /v1/embeddings and /v1/rerank."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from headrace.daemon import requests as rq
from headrace.daemon.errors import bad_request
from headrace.daemon.routes_openai import engine_for

EMBED_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents"}


def _texts(value: object, param: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{param}' must be a non-empty string or list of strings", param=param)
    for i, t in enumerate(value):
        if not isinstance(t, str) or not t:
            raise bad_request(f"'{param}[{i}]' must be a non-empty string (token arrays are not supported)",
                              param=f"{param}[{i}]")
    return value


async def embeddings(request: Request) -> Response:
    body = await rq.read_json(request, request.app.state.config.server.max_body_bytes)
    rq.check_fields(body, EMBED_FIELDS)
    slot = engine_for(request, rq.model_name(body), "embed", "embeddings")
    texts = _texts(body.get("input"), "input")
    fmt = rq.field(body, "encoding_format", str, "float", lambda v: v in ("float", "base64"), "'float' or 'base64'")
    dims = rq.field(body, "dimensions", int)
    if dims is not None and dims != slot.engine.dimensions:
        raise bad_request(f"'dimensions' must be {slot.engine.dimensions} for '{slot.name}' (it cannot be reduced)",
                          param="dimensions", code="unsupported_parameter")
    vectors = await slot.scheduler.submit(texts, len(texts))
    matrix = vectors.float().cpu().numpy().astype("<f4")
    data = [
        {"object": "embedding", "index": i,
         "embedding": base64.b64encode(row.tobytes()).decode() if fmt == "base64" else row.tolist()}
        for i, row in enumerate(matrix)
    ]
    n = slot.engine.count_tokens(texts)
    return JSONResponse({"object": "list", "data": data, "model": slot.name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


async def rerank(request: Request) -> Response:
    body = await rq.read_json(request, request.app.state.config.server.max_body_bytes)
    rq.check_fields(body, RERANK_FIELDS)
    slot = engine_for(request, rq.model_name(body), "rerank", "rerank")
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("'query' must be a non-empty string", param="query")
    docs = body.get("documents")
    if isinstance(docs, list):
        docs = [d.get("text") if isinstance(d, dict) else d for d in docs]
    docs = _texts(docs, "documents")
    top_n = rq.field(body, "top_n", int, len(docs), lambda v: v >= 1, "an integer >= 1")
    return_documents = rq.field(body, "return_documents", bool, True)
    scores = await slot.scheduler.submit((query, docs), len(docs))
    order = np.argsort(-scores.float().numpy(), kind="stable")[:top_n]
    results = []
    for i in order.tolist():
        item = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": slot.name, "results": results})
