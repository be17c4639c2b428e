"""OpenAI-compatible text routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from headrace.daemon import requests as rq
from headrace.daemon import structured
from headrace.daemon.errors import APIError, bad_request, internal
from headrace.daemon.schemas import ChatCompletionRequest, CompletionRequest
from headrace.plugins.protocols import SamplingParams, TokenDelta

DEFAULT_MAX_TOKENS = 256


def engine_for(request: Request, model: str, kind: str, what: str) -> Any:
    """The ready engine slot serving ``model``; 404/400/503 otherwise."""
    pool = request.app.state.pool
    slot = pool.slots.get(model)
    if slot is None:
        raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    if slot.engine.kind != kind:
        raise bad_request(f"the model '{model}' is an engine of kind '{slot.engine.kind}'; it does not serve {what}",
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


def _check_length(slot: Any, tokens: list[int], param: str) -> None:
    if not tokens:
        raise bad_request("the prompt is empty once tokenized", param=param)
    limit = getattr(slot.engine, "max_context_tokens", None)
    if limit is not None and len(tokens) >= limit:
        raise bad_request(f"the prompt is {len(tokens)} tokens; the model '{slot.name}' holds at most {limit}",
                          param=param, code="context_length_exceeded")


def vocab_size(engine: Any) -> int | None:
    """How many token ids the engine's model knows (None when the engine does not say)."""
    size = getattr(engine, "vocab_size", None)
    if size is None and getattr(engine, "tokenizer", None) is not None:
        size = len(engine.tokenizer)
    return size


def _check_token_ids(slot: Any, tokens: list[int]) -> None:
    size = vocab_size(slot.engine)
    if size is None:
        return
    for i, token in enumerate(tokens):
        if token >= size:
            raise bad_request(f"token id {token} is outside the vocabulary of '{slot.name}' (0 to {size - 1})",
                              param=f"prompt[{i}]")


async def _llm_request(request: Request, model: type[rq.Model], what: str) -> tuple[rq.Model, Any]:
    raw = await rq.read_json(request, request.app.state.config.server.max_body_bytes)
    body = rq.validate(model, raw)
    return body, engine_for(request, body.model, "llm", what)  # type: ignore[attr-defined]


async def chat_completions(request: Request) -> Response:
    body, slot = await _llm_request(request, ChatCompletionRequest, "chat completions")
    messages = structured.chat_messages(body)
    spec = rq.stream_spec(body)
    # Compiling a large schema takes a while: off the event loop, as tokenizing a long prompt is.
    schemas = structured.schema_chars(body)
    tools = await rq.off_loop_if_large(schemas, structured.plan_tools, body)
    constraint = (tools.constraint if tools is not None else
                  await rq.off_loop_if_large(schemas, structured.response_constraint, body))
    params = rq.sampling(body, DEFAULT_MAX_TOKENS, constraint)
    size = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools.specs)) if tools else 0)
    tokens = await rq.off_loop_if_large(size, _chat_tokens, slot.engine, messages, tools)
    _check_length(slot, tokens, "messages")
    return await _respond(request, slot, tokens, params, spec, chat=True, tools=tools)


def _chat_tokens(engine: Any, messages: list[dict[str, Any]], tools: structured.ToolPlan | None) -> list[int]:
    # Without tools, the call every engine has always taken (a plugin's chat_tokens may predate tools).
    return engine.chat_tokens(messages, tools.specs) if tools is not None else engine.chat_tokens(messages)


async def completions(request: Request) -> Response:
    body, slot = await _llm_request(request, CompletionRequest, "completions")
    prompt = rq.completion_prompt(body)
    spec = rq.stream_spec(body)
    constraint = await rq.off_loop_if_large(structured.schema_chars(body), structured.response_constraint, body)
    params = rq.sampling(body, 16, constraint)  # 16: OpenAI's default for completions
    if isinstance(prompt, str):
        tokens = await rq.off_loop_if_large(len(prompt), slot.engine.encode, prompt)
    else:
        tokens = list(prompt)
        _check_token_ids(slot, tokens)
    _check_length(slot, tokens, "prompt")
    return await _respond(request, slot, tokens, params, spec, chat=False)


async def _collect(request: Request, deltas: AsyncIterator[TokenDelta]) -> tuple[str, int, str | None] | None:
    """Drain a non-streamed generation; None when the client disconnected first (the generation is aborted)."""
    text: list[str] = []
    generated, finish, gone = 0, None, False
    failed: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()  # closing the deltas below cancels the run and frees its context

        tg.start_soon(watch)
        try:
            async with aclosing(deltas):
                async for d in deltas:
                    text.append(d.text)
                    generated += len(d.token_ids)
                    finish = d.finish_reason or finish
        except Exception as exc:  # raised below, outside the task group, so it is not wrapped in a group
            failed = exc
        tg.cancel_scope.cancel()
    if failed is not None:
        # An APIError, answered by its handler, keeps the connection open (the 500 handler closes it).
        raise internal(failed, "the generation")
    return None if gone else ("".join(text), generated, finish)


async def _respond(request: Request, slot: Any, tokens: list[int], params: SamplingParams, spec: rq.StreamSpec,
                   chat: bool, tools: structured.ToolPlan | None = None) -> Response:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    # A one-request run through the graph executor: the same batching path as workflows.
    deltas = request.app.state.workflows.generate(slot.name, tokens, params)
    if not spec.stream:
        collected = await _collect(request, deltas)
        if collected is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        content, generated, finish = collected
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if tools is not None:
                text, calls = structured.parse_tool_output(content, tools.names)
                if calls:
                    message = {"role": "assistant", "content": text, "tool_calls": calls}
                    finish = "tool_calls" if finish == "stop" else finish
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": slot.name, "choices": [choice], "usage": _usage(len(tokens), generated),
        })
    return StreamingResponse(
        _sse(_chunks(rid, created, slot.name, len(tokens), deltas, spec, chat, tools)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _chunks(rid: str, created: int, model: str, n_prompt: int, deltas: AsyncIterator[TokenDelta],
                  spec: rq.StreamSpec, chat: bool, tools: structured.ToolPlan | None = None
                  ) -> AsyncIterator[dict[str, Any]]:
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}
    extra = {"usage": None} if spec.include_usage else {}

    def chunk(text: str | None, finish: str | None, role: bool = False,
              call: tuple[int, dict[str, Any]] | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if call is not None:  # a whole call in one delta: its id, name and complete arguments
                delta = {"tool_calls": [{"index": call[0], **call[1]}]}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    if chat:
        yield chunk(None, None, role=True)
    parser = structured.ToolCallParser(tools.names) if tools is not None else None
    generated = calls_sent = 0
    async with aclosing(deltas):
        async for d in deltas:
            generated += len(d.token_ids)
            if parser is None:
                if d.text or d.finish_reason:
                    yield chunk(d.text, d.finish_reason)
                continue
            # Tools: content as it comes, each call once its block is complete.
            items = parser.feed(d.text) + (parser.finish() if d.finish_reason else [])
            for kind, value in items:
                if kind == "content":
                    yield chunk(value, None)
                else:
                    yield chunk(None, None, call=(calls_sent, value))
                    calls_sent += 1
            if d.finish_reason:
                yield chunk(None, "tool_calls" if parser.calls and d.finish_reason == "stop" else d.finish_reason)
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
        err = internal(exc, "the generation")
        yield f"data: {json.dumps(err.body())}\n\n"
    yield "data: [DONE]\n\n"
