"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../input_items.

A Responses request is served as a chat request: its items become chat messages, its flat function
tools chat's ``tools``, ``text.format`` chat's ``response_format``, and the resulting
``ChatCompletionRequest`` goes through the chat route's own checks, sampling and constraints
(``openai_api.plan_chat``), so every chat field the request maps onto means the same here.

A continued response (``previous_response_id``) is its predecessor's program: the conversation
(every earlier turn's input and output, from the store) is rebuilt server-side and generated under the
chain's program id, so the ``las`` policy ranks it by the chain's service and a turn that ends in tool
calls keeps its context pinned for the next (``headrace.daemon.retention``); its earlier tokens are
found in the prefix cache, not prefilled (``usage.input_tokens_details.cached_tokens``).

A response is stored (``store``, default true) only once it is whole: a request that fails, or whose
client leaves, stores nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from headrace.batching.programs import PROGRAM_HEADER, program_of
from headrace.daemon import bodies as rq
from headrace.daemon.cache_partition import cache_partition
from headrace.daemon.errors import APIError, bad_request, internal
from headrace.daemon.openai_schemas import ChatCompletionRequest
from headrace.daemon.responses_schemas import (PEER_SAMPLING, FunctionCallItem, FunctionCallOutputItem,
                                               InputItemsQuery, MessageItem, ResponseRequest)
from headrace.daemon.responses_store import ResponsesStore, StoredResponse
from headrace.daemon.routes.openai_api import collect, engine_for, generation, plan_chat
from headrace.daemon.routes.responses_output import Output
from headrace.daemon.ownership import caller, mine
from headrace.daemon.services import daemon, services
from headrace.graph.collector import ChoiceDelta


def _store(request: Request) -> ResponsesStore:
    return services(request).responses


def _not_found(response_id: str, param: str | None = None) -> APIError:
    # Another key's response is as unknown as a missing or expired one.
    return APIError(404, f"no response with id '{response_id}'", param=param, code="response_not_found")


# ----- items -> chat ----------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", p.get("refusal", "")) if isinstance(p, dict) else
                   getattr(p, "text", None) or getattr(p, "refusal", "") for p in content)


def input_items(body: ResponseRequest) -> list[dict[str, Any]]:
    """The request's input as stored items (OpenAI's input-item shapes), each with an id."""
    if isinstance(body.input, str):
        return [{"id": _new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": body.input}]}]
    items = []
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            part = "output_text" if item.role == "assistant" else "input_text"
            content = ([{"type": part, "text": item.content, **({"annotations": []} if item.role == "assistant" else {})}]
                       if isinstance(item.content, str) else [p.model_dump(exclude_none=True) for p in item.content])
            items.append({"id": item.id or _new_id("msg"), "type": "message", "role": item.role,
                          "status": item.status or "completed", "content": content})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments or "{}")
            except json.JSONDecodeError:
                raise bad_request("a function call's 'arguments' is not JSON", param=f"input[{i}].arguments") from None
            items.append({"id": item.id or _new_id("fc"), "type": "function_call", "call_id": item.call_id,
                          "name": item.name, "arguments": item.arguments, "status": item.status or "completed"})
        else:
            assert isinstance(item, FunctionCallOutputItem)
            items.append({"id": item.id or _new_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                          "output": _text(item.output), "status": item.status or "completed"})
    return items


def chat_messages(instructions: str | None, context: list[dict[str, Any]],
                  items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages; a ``function_call_output`` must follow its ``function_call``
    (400 naming the new item that breaks that)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    called: set[str] = set()
    for i, item in enumerate([*context, *items]):
        new = i - len(context)  # the index in this request's input, for an error
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif item["type"] == "function_call":
            called.add(item["call_id"])
            arguments = item["arguments"]
            try:
                json.loads(arguments or "{}")
            except json.JSONDecodeError:  # a stored call max_output_tokens cut off: its arguments never closed
                arguments = "{}"
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                             "arguments": arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # one turn's calls are one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item["call_id"] not in called:
                raise bad_request(f"no function_call with call_id '{item['call_id']}' precedes this "
                                  "function_call_output", param=f"input[{new}].call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not messages:
        raise bad_request("the input holds no message", param="input")
    return messages


def chat_request(body: ResponseRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request is served as."""
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        if fmt.type == "json_schema":
            spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in spec.items() if v is not None}}
        else:
            chat["response_format"] = {"type": fmt.type}
    for name, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls),
                        *((field, getattr(body, field)) for field in PEER_SAMPLING)):
        if value is not None:
            chat[name] = value
    return rq.validate(ChatCompletionRequest, chat)


# Chat's names for a field, and the Responses request's: an error names the field the client sent.
_RENAMES = (("response_format", "text.format"), ("messages", "input"), ("max_completion_tokens", "max_output_tokens"))


def _renamed(exc: APIError) -> APIError:
    param = exc.param
    if param:
        for chat, ours in _RENAMES:
            if param == chat or param.startswith((chat + ".", chat + "[")):
                param = ours + param[len(chat):]
        param = param.replace(".function.", ".")  # tools[i].function.parameters -> tools[i].parameters
        exc.message = exc.message.replace(f"'{exc.param}'", f"'{param}'")
        exc.param = param
    for chat, ours in _RENAMES:  # a message naming another field too ('min_tokens' is more than 'max_...')
        exc.message = exc.message.replace(f"'{chat}'", f"'{ours}'")
    return exc


# ----- the response object --------------------------------------------------------------------


def response_object(rid: str, created: int, body: ResponseRequest, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    choice = body.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "model": body.model, "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None else
        ("auto" if body.tools else "none"),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "store": body.store is not False, "background": False, "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None}, "user": body.user,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "usage": usage,
    }


def _usage(prompt: int, generated: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": min(prompt, cached)},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


# ----- routes -----------------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(ResponseRequest, raw)
    if body.stream_options is not None and not body.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    slot = engine_for(request, body.model, "llm", "responses")
    partition = cache_partition(request, body.cache_salt, slot.engine)
    who = caller(request)
    previous = None
    if body.previous_response_id is not None:
        previous = mine(request, await _store(request).get(body.previous_response_id))
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        if body.cache_salt is None and previous.salted_partition:
            partition = previous.salted_partition  # the chain's salt, which its first turn sent
    items = input_items(body)
    context = previous.conversation() if previous is not None else []
    try:
        chat = await plan_chat(slot, chat_request(body, chat_messages(body.instructions, context, items)))
    except APIError as exc:
        raise _renamed(exc) from None
    rid, created, store = _new_id("resp"), int(time.time()), body.store is not False
    # The chain's program: a continued turn joins its predecessor's; a first one names its own (or the
    # client's prompt_cache_key / user), so that its successors can join it.
    program = previous.program if previous is not None else program_of(
        body.prompt_cache_key, body.user, request.headers.get(PROGRAM_HEADER), who)
    if program is None and store:
        program = f"{who}/response:{rid}" if who is not None else f"response:{rid}"
    deltas = generation(request, slot, [chat.tokens], chat.params, 1, True, chat.tools, program, chat.pins,
                        partition)
    salted = partition if body.cache_salt is not None or (previous is not None and previous.salted_partition) else ""
    turn = Turn(_store(request) if store else None, StoredResponse(rid, who, created, program or "", {}, items,
                                                                   context, salted))
    if not body.stream:
        collected = await collect(request, deltas, 1)
        if collected is None:
            return Response(status_code=499)  # the client left: nothing is stored
        c = collected[0]
        output = Output(chat.tools)
        output.feed("".join(c.text), c.finish)
        final = response_object(rid, created, body, output.status, output.items,
                                _usage(len(chat.tokens), c.generated, c.cached))
        await turn.keep(final)
        return JSONResponse(final)
    return StreamingResponse(_sse(_events(rid, created, body, len(chat.tokens), deltas, Output(chat.tools), turn)),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class Turn:
    """Where a finished response goes: the store (``store``), or nowhere."""

    def __init__(self, store: ResponsesStore | None, stored: StoredResponse) -> None:
        self.store, self.stored = store, stored

    async def keep(self, response: dict[str, Any]) -> None:
        if self.store is not None:
            self.stored.response = response
            await self.store.put(self.stored)


async def _events(rid: str, created: int, body: ResponseRequest, n_prompt: int, deltas: AsyncIterator[ChoiceDelta],
                  output: Output, turn: Turn) -> AsyncIterator[dict[str, Any]]:
    """The response's semantic events, as OpenAI's Responses stream sends them."""
    yield {"type": "response.created", "response": response_object(rid, created, body, "in_progress", [], None)}
    yield {"type": "response.in_progress", "response": response_object(rid, created, body, "in_progress", [], None)}
    generated = cached = 0
    async with aclosing(deltas):
        async for c in deltas:
            generated += len(c.delta.token_ids)
            cached += c.delta.cached_tokens
            for event in output.feed(c.delta.text, c.delta.finish_reason):
                yield event
    final = response_object(rid, created, body, output.status, output.items, _usage(n_prompt, generated, cached))
    await turn.keep(final)  # stored before the client hears it is complete: a GET right after finds it
    yield {"type": f"response.{output.status}", "response": final}


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Each event as SSE, named by its type and numbered; a failure after the stream began is an ``error`` event."""
    sequence = 0

    def frame(event: dict[str, Any]) -> str:
        nonlocal sequence
        event = {**event, "sequence_number": sequence}
        sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    try:
        async with aclosing(events):
            async for event in events:
                yield frame(event)
    except Exception as exc:
        err = exc if isinstance(exc, APIError) else internal(exc, "the generation")
        yield frame({"type": "error", "code": err.code, "message": err.message, "param": err.param})


async def get_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = mine(request, await _store(request).get(response_id))
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = mine(request, await _store(request).get(response_id))
    if stored is None or not await _store(request).delete(response_id, stored.owner):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: Request) -> Response:
    """A stored response's input items (this turn's, as OpenAI lists them), a page at a time."""
    response_id = request.path_params["response_id"]
    query = rq.validate(InputItemsQuery, dict(request.query_params))
    stored = mine(request, await _store(request).get(response_id))
    if stored is None:
        raise _not_found(response_id)
    items = stored.input_items if query.order == "asc" else stored.input_items[::-1]
    if query.after is not None:
        ids = [item["id"] for item in items]
        if query.after not in ids:
            raise APIError(404, f"no input item '{query.after}' to list after", param="after", code="item_not_found")
        items = items[ids.index(query.after) + 1:]
    page = items[:query.limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})
