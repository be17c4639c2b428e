"""OpenAI-style retrieval routes: /v1/embeddings and /v1/rerank."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from headrace.batching import requests as engine_requests
from headrace.batching.meta import PrimitiveMeta
from headrace.daemon import bodies as rq
from headrace.daemon.cache_partition import cache_partition
from headrace.daemon.errors import bad_request
from headrace.daemon.routes.openai_api import engine_for
from headrace.daemon.openai_schemas import EmbeddingRequest, RerankRequest
from headrace.daemon.services import daemon
from headrace.graph.executor import new_run_id
from headrace.plugins.protocols import TokenInput


async def embeddings(request: Request) -> Response:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(EmbeddingRequest, raw)
    slot = engine_for(request, body.model, "embed", "embeddings")
    texts = await _input_texts(slot, body.input)
    fmt = body.encoding_format or "float"
    if body.dimensions is not None and body.dimensions != slot.engine.dimensions:
        raise bad_request(f"'dimensions' must be {slot.engine.dimensions} for '{slot.name}' (it cannot be reduced)",
                          param="dimensions", code="unsupported_parameter")
    vectors = await slot.scheduler.submit(engine_requests.EmbedRequest(tuple(texts)), len(texts))
    matrix = vectors.float().cpu().numpy().astype("<f4")
    data = [
        {"object": "embedding", "index": i,
         "embedding": base64.b64encode(row.tobytes()).decode() if fmt == "base64" else row.tolist()}
        for i, row in enumerate(matrix)
    ]
    n = slot.engine.count_tokens(texts)
    return JSONResponse({"object": "list", "data": data, "model": slot.name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


async def _input_texts(slot: Any, given: str | list[str] | list[int] | list[list[int]]) -> list[str]:
    """The texts to embed. Token ids (what LangChain's OpenAIEmbeddings sends) are the model's own tokenizer's ids, as
    vLLM reads them, and decoded with it: ids of another tokenizer (tiktoken's) embed unrelated text."""
    if isinstance(given, str):
        return [given]
    if isinstance(given[0], str):
        return given  # type: ignore[return-value]
    rows: list[list[int]] = [given] if isinstance(given[0], int) else given  # type: ignore[list-item,assignment]
    engine = slot.engine
    if not isinstance(engine, TokenInput):
        raise bad_request(f"the model '{slot.name}' takes text only, not token ids", param="input",
                          code="unsupported_parameter")
    for i, row in enumerate(rows):
        for j, token in enumerate(row):
            if token >= engine.vocab_size:
                where = f"input[{i}][{j}]" if rows is given else f"input[{j}]"
                raise bad_request(f"token id {token} is outside the vocabulary of '{slot.name}' "
                                  f"(0 to {engine.vocab_size - 1})", param=where)
    texts = await rq.off_loop_if_large(sum(map(len, rows)), engine.decode_tokens, rows)
    for i, text in enumerate(texts):
        if not text:
            raise bad_request("the token ids spell no text (only special tokens)",
                              param="input" if len(rows) == 1 else f"input[{i}]")
    return texts


async def rerank(request: Request) -> Response:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(RerankRequest, raw)
    slot = engine_for(request, body.model, "rerank", "rerank")
    limit = daemon(request).config.server.max_rerank_documents
    if len(body.documents) > limit:
        raise bad_request(f"'documents' holds {len(body.documents)} documents; at most {limit} per request",
                          param="documents", code="too_many_documents")
    query = body.query
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    top_n = body.top_n or len(docs)
    return_documents = body.return_documents is not False
    # The caller's cache partition: an LLM judge scoring through its LLM's prefix cache (document first) reuses only
    # what this key (where keys are kept apart) scored before.
    meta = PrimitiveMeta(run=daemon(request).workflows.id_prefix + new_run_id(), node="rerank",
                         cache_partition=cache_partition(request))
    scores = await slot.scheduler.submit(engine_requests.RerankRequest(query, tuple(docs), meta), len(docs), meta)
    order = np.argsort(-scores.float().numpy(), kind="stable")[:top_n]
    results = []
    for i in order.tolist():
        item = {"index": i, "relevance_score": float(scores[i])}
        if return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": slot.name, "results": results})
