"""OpenAI-compatible text routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from headrace.daemon import requests as rq
from headrace.daemon.errors import APIError, bad_request
from headrace.plugins.protocols import SamplingParams, TokenDelta

DEFAULT_MAX_TOKENS = 256


def engine_for(request: Request, model: str, kind: str, what: str) -> Any:
    """The ready engine slot serving ``model``; 404/400/503 otherwise."""
    pool = request.app.state.pool
    slot = pool.slots.get(model)
    if slot is None:
        raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    if slot.engine.kind != kind:
        raise bad_request(f"the model '{model}' is a {slot.engine.kind} engine; it does not serve {what}",
                          param="model", code="model_not_supported")
    if slot.state != "ready":
        raise APIError(503, f"the model '{model}' is {slot.state}, not ready", code="model_not_ready")
    return slot


async def list_models(request: Request) -> Response:
    pool = request.app.state.pool
    data = [
        {"id": s.name, "object": "model", "created": s.created, "owned_by": "headrace",
         "kind": s.engine.kind, "plugin": s.plugin, "ready": s.state == "ready"}
        for s in pool.slots.values()
    ]
    return JSONResponse({"object": "list", "data": data})


def _check_length(slot: Any, tokens: list[int]) -> None:
    limit = getattr(slot.engine, "max_context_tokens", None)
    if limit is not None and len(tokens) >= limit:
        raise bad_request(f"the prompt is {len(tokens)} tokens; the model '{slot.name}' holds at most {limit}",
                          param="messages", code="context_length_exceeded")


async def _llm_request(request: Request, fields: set[str], what: str) -> tuple[dict[str, Any], Any]:
    body = await rq.read_json(request, request.app.state.config.server.max_body_bytes)
    rq.check_fields(body, fields)
    return body, engine_for(request, rq.model_name(body), "llm", what)


async def chat_completions(request: Request) -> Response:
    body, slot = await _llm_request(request, rq.CHAT_FIELDS, "chat completions")
    messages = rq.chat_messages(body)
    spec = rq.stream_spec(body)
    params = rq.sampling(body, DEFAULT_MAX_TOKENS, chat=True)
    tokens = slot.engine.chat_tokens(messages)
    _check_length(slot, tokens)
    return await _respond(request, slot, tokens, params, spec, chat=True)


async def completions(request: Request) -> Response:
    body, slot = await _llm_request(request, rq.COMPLETION_FIELDS, "completions")
    prompt = rq.completion_prompt(body)
    spec = rq.stream_spec(body)
    params = rq.sampling(body, 16, chat=False)  # OpenAI's default for completions
    tokens = slot.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    _check_length(slot, tokens)
    return await _respond(request, slot, tokens, params, spec, chat=False)


async def _respond(request: Request, slot: Any, tokens: list[int], params: SamplingParams, spec: rq.StreamSpec,
                   chat: bool) -> Response:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    # A one-request run through the graph executor: the same batching path as workflows.
    deltas = request.app.state.workflows.generate(slot.name, tokens, params)
    if not spec.stream:
        text, generated, finish = [], 0, None
        async with aclosing(deltas):
            async for d in deltas:
                text.append(d.text)
                generated += len(d.token_ids)
                finish = d.finish_reason or finish
        content = "".join(text)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": finish}
            if chat
            else {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
        )
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": slot.name, "choices": [choice], "usage": _usage(len(tokens), generated),
        })
    return StreamingResponse(
        _sse(_chunks(rid, created, slot.name, len(tokens), deltas, spec, chat)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _chunks(rid: str, created: int, model: str, n_prompt: int, deltas: AsyncIterator[TokenDelta],
                  spec: rq.StreamSpec, chat: bool) -> AsyncIterator[dict[str, Any]]:
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}
    extra = {"usage": None} if spec.include_usage else {}

    def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    if chat:
        yield chunk(None, None, role=True)
    generated = 0
    async with aclosing(deltas):
        async for d in deltas:
            generated += len(d.token_ids)
            if d.text or d.finish_reason:
                yield chunk(d.text, d.finish_reason)
    if spec.include_usage:
        yield {**base, "choices": [], "usage": _usage(n_prompt, generated)}


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Frame chunks as SSE; an error after the stream began is sent as an event, then [DONE]."""
    try:
        async with aclosing(chunks):
            async for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception as exc:
        err = APIError(500, f"{type(exc).__name__}: {exc}", code="engine_error")
        yield f"data: {json.dumps(err.body())}\n\n"
    yield "data: [DONE]\n\n"
