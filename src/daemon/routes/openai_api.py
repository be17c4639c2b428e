"""OpenAI-compatible text routes: /v1/models, /v1/models/{model}, /v1/chat/completions, /v1/completions.

Completions' ``echo`` and vLLM's ``prompt_logprobs`` score the prompt first (``headrace.daemon.prompt_logprobs``).
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from headrace.batching.programs import PROGRAM_HEADER, ProgramRegistry, program_of
from headrace.daemon import bodies as rq
from headrace.daemon import prompt_logprobs as scoring
from headrace.daemon import retention, structured
from headrace.daemon.cache_partition import cache_partition
from headrace.daemon.errors import APIError, bad_request, internal
from headrace.daemon.logprobs import CompletionLogprobs, TokenStrings, chat_content
from headrace.daemon.prompt_logprobs import ScoredPrompt, ScoringPlan
from headrace.daemon.openai_schemas import COMPLETIONS_MAX_TOKENS, MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from headrace.daemon.services import daemon, owner, services
from headrace.graph.collector import ChoiceDelta
from headrace.plugins.engines.llm.chat import NoChatTemplate
from headrace.plugins.protocols import DEFAULT_MAX_TOKENS, ReportsLogprobs, SamplingParams, TokenDelta, TokenLogprob


def engine_for(request: Request, model: str, kind: str, what: str) -> Any:
    """The ready engine slot serving ``model``; 404/400/503 otherwise."""
    pool = daemon(request).pool
    slot = pool.slots.get(model)
    if slot is None:
        raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    if slot.engine.kind != kind:
        raise bad_request(f"the model '{model}' is an engine of kind '{slot.engine.kind}'; it does not serve {what}",
                          param="model", code="model_not_supported")
    if slot.state != "ready":
        raise APIError(503, f"the model '{model}' is {slot.state}, not ready", code="model_not_ready")
    return slot


def _model_card(slot: Any) -> dict[str, Any]:
    return {"id": slot.name, "object": "model", "created": slot.created, "owned_by": "headrace",
            "kind": slot.engine.kind, "plugin": slot.plugin, "ready": slot.state == "ready",
            # Under a memory budget a ready model may be unloaded: a request to it waits while it loads.
            "residency": {"state": slot.residency, "pinned": slot.pinned, "footprint_bytes": slot.footprint,
                          "footprint_source": slot.footprint_source, "loads": slot.loads,
                          "load_seconds": None if slot.load_seconds is None else round(slot.load_seconds, 3)}}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(s) for s in daemon(request).pool.slots.values()]})


async def get_model(request: Request) -> Response:
    """One model's card, whatever its state (OpenAI's retrieve-model); 404 for an unknown id."""
    model = request.path_params["model"]
    slot = daemon(request).pool.slots.get(model)
    if slot is None:
        raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    return JSONResponse(_model_card(slot))


def _check_logprobs(slot: Any, params: SamplingParams, param: str) -> None:
    if params.logprobs is not None and not (isinstance(slot.engine, ReportsLogprobs) and slot.engine.reports_logprobs):
        raise bad_request(f"the model '{slot.name}' does not report log-probabilities", param=param,
                          code="unsupported_parameter")


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


def check_vocab(slot: Any, tokens: list[int], param: str = "prompt") -> None:
    size = vocab_size(slot.engine)
    if size is None:
        return
    for i, token in enumerate(tokens):
        if token >= size:
            raise bad_request(f"token id {token} is outside the vocabulary of '{slot.name}' (0 to {size - 1})",
                              param=f"{param}[{i}]")


def check_sampling_vocab(slot: Any, body: Any) -> None:
    """The token ids of the body's sampling settings (logit_bias keys, stop_token_ids) are the model's."""
    size = vocab_size(slot.engine)
    for param, token in rq.sampling_token_ids(body):
        if size is not None and token >= size:
            raise bad_request(f"token id {token} is outside the vocabulary of '{slot.name}' (0 to {size - 1})",
                              param=param)


async def _llm_request(request: Request, model: type[rq.Model], what: str) -> tuple[rq.Model, Any]:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(model, raw)
    return body, engine_for(request, body.model, "llm", what)  # type: ignore[attr-defined]


async def chat_completions(request: Request) -> Response:
    body, slot = await _llm_request(request, ChatCompletionRequest, "chat completions")
    spec = rq.stream_spec(body)
    plan = scoring.chat_plan(slot, body, spec)
    partition = cache_partition(request, body.cache_salt, slot.engine)
    chat = await plan_chat(slot, body)
    return await _respond(request, slot, [chat.tokens], chat.params, body.n or 1, spec, chat=True, tools=chat.tools,
                          program=_program(request, body), pins=chat.pins, plan=plan, partition=partition)


@dataclass(frozen=True)
class ChatPlan:
    """What a checked chat request asks the engine for (the Responses route builds one too)."""

    tokens: list[int]  # the prompt, through the chat template
    params: SamplingParams
    tools: structured.ToolPlan | None
    pins: list[tuple[int, float]]  # its cache_control marks: (prompt tokens, TTL)


async def plan_chat(slot: Any, body: ChatCompletionRequest) -> ChatPlan:
    """The prompt, sampling, tools and pins of a validated chat request; 400 for what cannot be served."""
    messages = structured.chat_messages(body)
    # Compiling a large schema takes a while: off the event loop, as tokenizing a long prompt is.
    schemas = structured.schema_chars(body)
    tools = await rq.off_loop_if_large(schemas, structured.plan_tools, body)
    constraint = (tools.constraint if tools is not None else
                  await rq.off_loop_if_large(schemas, structured.response_constraint, body))
    params = rq.sampling(body, DEFAULT_MAX_TOKENS, constraint)
    _check_logprobs(slot, params, "logprobs")
    check_sampling_vocab(slot, body)
    size = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools.specs)) if tools else 0)
    tokens = await rq.off_loop_if_large(size, _chat_tokens, slot.engine, messages, tools)
    _check_length(slot, tokens, "messages")
    marked = retention.marks(body)
    prefixes = await rq.off_loop_if_large(size * len(marked), retention.marked_prefixes, slot.engine, messages,
                                          tools, tokens, marked) if marked else []
    return ChatPlan(tokens, params, tools, prefixes)


def _chat_tokens(engine: Any, messages: list[dict[str, Any]], tools: structured.ToolPlan | None) -> list[int]:
    # Without tools, the call every engine has always taken (a plugin's chat_tokens may predate tools).
    with no_template_is_400():
        return engine.chat_tokens(messages, tools.specs) if tools is not None else engine.chat_tokens(messages)


@contextmanager
def no_template_is_400() -> Iterator[None]:
    """A chat prompt for a model without a chat template: a 400 naming the engine's ``chat_template`` option."""
    try:
        yield
    except NoChatTemplate as exc:
        raise bad_request(str(exc), param="messages", code="no_chat_template") from None


async def completions(request: Request) -> Response:
    body, slot = await _llm_request(request, CompletionRequest, "completions")
    partition = cache_partition(request, body.cache_salt, slot.engine)
    prompts = rq.completion_prompts(body)
    spec = rq.stream_spec(body)
    plan = scoring.completion_plan(slot, body, spec)
    constraint = await rq.off_loop_if_large(structured.schema_chars(body), structured.response_constraint, body)
    params = rq.sampling(body, COMPLETIONS_MAX_TOKENS, constraint)
    if plan is None or plan.generate:  # the output's logprobs: the decode reports them
        _check_logprobs(slot, params, "logprobs")
    check_sampling_vocab(slot, body)
    n = body.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts with n={n} make {len(prompts) * n} choices; at most {MAX_CHOICES}",
                          param="n")
    texts = [p for p in prompts if isinstance(p, str)]
    if texts:  # all of a request's texts in one go: off the loop when together they are large
        encoded = iter(await rq.off_loop_if_large(sum(map(len, texts)), _encode_all, slot.engine, texts))
    token_lists = []
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            tokens = next(encoded)
        else:
            tokens = list(prompt)
            check_vocab(slot, tokens, where)
        _check_length(slot, tokens, where)
        token_lists.append(tokens)
    echoed = await scoring.prompts_as_sent(slot, token_lists, prompts) if plan is not None else None
    return await _respond(request, slot, token_lists, params, n, spec, chat=False, program=_program(request, body),
                          plan=plan, echoed=echoed, partition=partition)


def _program(request: Request, body: Any) -> str | None:
    """The program the request joins: ``prompt_cache_key``, else ``user``, else the ``X-Headrace-Program``
    header (``headrace.batching.programs``), per API key; None: a program of one call."""
    return program_of(body.prompt_cache_key, body.user, request.headers.get(PROGRAM_HEADER), owner(request))


async def _served(deltas: AsyncIterator[ChoiceDelta], registry: ProgramRegistry, program: str,
                  n_prompt: int) -> AsyncIterator[ChoiceDelta]:
    """``deltas``, counting to its program the tokens the engine computed for the request once it ends (however):
    its prompt less what the prefix cache held (as the engine tells), and what it generated."""
    generated = cached = 0
    try:
        async with aclosing(deltas):
            async for c in deltas:
                generated += len(c.delta.token_ids)
                cached += c.delta.cached_tokens
                yield c
    finally:
        registry.add(program, max(0, n_prompt - cached) + generated)


def _encode_all(engine: Any, texts: list[str]) -> list[list[int]]:
    """Whole prompts, as the model's tokenizer makes them (its BOS, where it adds one)."""
    return [list(engine.prompt_tokens(text)) for text in texts]


@dataclass
class Choice:
    """What one choice has generated so far (a non-streamed response)."""

    text: list[str] = field(default_factory=list)
    generated: int = 0
    cached: int = 0  # prompt tokens its engine found in the prefix cache
    finish: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, d: TokenDelta) -> None:
        self.text.append(d.text)
        self.generated += len(d.token_ids)
        self.cached += d.cached_tokens
        self.finish = d.finish_reason or self.finish
        self.logprobs.extend(d.logprobs)


async def collect(request: Request, deltas: AsyncIterator[ChoiceDelta], count: int) -> list[Choice] | None:
    """Drain a non-streamed generation; None when the client disconnected first (the generation is aborted)."""
    choices = [Choice() for _ in range(count)]
    gone = False
    failed: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()  # closing the deltas below cancels the run and frees its contexts

        tg.start_soon(watch)
        try:
            async with aclosing(deltas):
                async for c in deltas:
                    choices[c.index].add(c.delta)
        except Exception as exc:  # raised below, outside the task group, so it is not wrapped in a group
            failed = exc
        tg.cancel_scope.cancel()
    if failed is not None:
        # An APIError, answered by its handler, keeps the connection open (the 500 handler closes it).
        raise internal(failed, "the generation")
    return None if gone else choices


async def _respond(request: Request, slot: Any, prompts: list[list[int]], params: SamplingParams, n: int,
                   spec: rq.StreamSpec, chat: bool, tools: structured.ToolPlan | None = None,
                   program: str | None = None, pins: list[tuple[int, float]] | None = None,
                   plan: ScoringPlan | None = None, echoed: list[ScoredPrompt] | None = None,
                   partition: str = "") -> Response:
    """Generate and answer; with a ``plan``, the prompts (``echoed``: completions' own) are scored first.
    ``partition``: the cached KV the request may reuse (``cache_partition``)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    count = len(prompts) * n
    n_prompt = sum(map(len, prompts))  # each prompt counted once, however many choices fork it (as vLLM counts)
    strings = TokenStrings(slot.engine.tokenizer) if params.logprobs is not None else None
    names = strings  # the scored prompt's tokens' strings
    if plan is not None:
        echoed = echoed or [ScoredPrompt(p, "") for p in prompts]
        if plan.scores:
            names = strings or TokenStrings(slot.engine.tokenizer)
            if not await scoring.score(request, slot, echoed, plan, program, partition):
                return Response(status_code=499)  # the client left while its prompts were scored
    if plan is None or plan.generate:
        deltas = generation(request, slot, prompts, params, n, chat, tools, program, pins, partition)
    else:
        deltas = _nothing()
    if not spec.stream:
        collected = await collect(request, deltas, count)
        if collected is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        choices = [_choice(i, c, strings, chat, tools) for i, c in enumerate(collected)]
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": slot.name, "choices": choices,
               "usage": _usage(n_prompt, sum(c.generated for c in collected), sum(c.cached for c in collected))}
        if plan is not None and echoed is not None:
            if chat and names is not None:  # vLLM's chat puts them on the response, its completions on each choice
                out["prompt_logprobs"] = scoring.vllm_entries(echoed[0], plan, names)
            else:
                for i, (choice, c) in enumerate(zip(choices, collected)):
                    if not plan.generate:
                        choice["finish_reason"] = "length"  # max_tokens 0: the prompt is all there is
                    scoring.completion_choice(choice, echoed[i // n], plan, names, c.logprobs)
        return JSONResponse(out)
    echo = (plan, [echoed[i // n] for i in range(count)]) if plan is not None and plan.echo and echoed else None
    return StreamingResponse(
        _sse(_chunks(rid, created, slot.name, n_prompt, count, deltas, spec, chat, strings, tools, echo)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _nothing() -> AsyncIterator[ChoiceDelta]:
    return
    yield  # an async generator that ends at once: max_tokens 0 generates nothing


def generation(request: Request, slot: Any, prompts: list[list[int]], params: SamplingParams, n: int, chat: bool,
               tools: structured.ToolPlan | None = None, program: str | None = None,
               pins: list[tuple[int, float]] | None = None, partition: str = "") -> AsyncIterator[ChoiceDelta]:
    """The deltas of ``prompts`` generated as one request: counted to ``program``, a chat turn's pins made after;
    it reuses only the cached KV of its ``partition`` (``cache_partition``)."""
    n_prompt = sum(map(len, prompts))
    # A one-request run through the graph executor: the same batching path as workflows. A named program
    # brings the tokens its earlier requests were served (``las`` ranks by them) and adds this one's.
    registry = services(request).programs
    if program is None:
        deltas = daemon(request).workflows.generate_choices(slot.name, prompts, params, n, cache_partition=partition)
    else:
        registry.back(program)
        deltas = _served(daemon(request).workflows.generate_choices(
            slot.name, prompts, params, n, program=program, attained_tokens=registry.attained(program),
            cache_partition=partition), registry, program, n_prompt)
    retained = program if slot.retention else None  # switched off: the program's turns are served as LRU finds them
    if chat and (pins or retained is not None):  # a chat turn's pins (headrace.daemon.retention)
        deltas = retention.pinned_after(deltas, slot.engine, prompts[0], tools, retained, registry, pins or [],
                                        partition)
    return deltas


def _choice(index: int, c: Choice, strings: TokenStrings | None, chat: bool,
            tools: structured.ToolPlan | None = None) -> dict[str, Any]:
    text = "".join(c.text)
    if chat:
        logprobs = None if strings is None else {"content": chat_content(c.logprobs, strings)}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = c.finish
        if tools is not None:
            content, calls = structured.parse_tool_output(text, tools.names, cut=finish == "length")
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    logprobs = None if strings is None else CompletionLogprobs(strings).add(c.logprobs)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish}


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage object. ``cached``: prompt tokens served from the prefix cache, as the engine tells (each
    choice's own prefill: with ``n`` > 1 the shared prompt's prefill is no choice's, so its hits are not in it)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(prompt, cached)}}


async def _chunks(rid: str, created: int, model: str, n_prompt: int, count: int, deltas: AsyncIterator[ChoiceDelta],
                  spec: rq.StreamSpec, chat: bool, strings: TokenStrings | None,
                  tools: structured.ToolPlan | None = None,
                  echo: tuple[ScoringPlan, list[ScoredPrompt]] | None = None) -> AsyncIterator[dict[str, Any]]:
    """The SSE chunks; ``echo``: each completions choice's prompt (by choice) goes first, in a chunk of its own."""
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model}
    extra = {"usage": None} if spec.include_usage else {}
    # Completions' text_offset runs on over a choice's chunks.
    offsets = [CompletionLogprobs(strings) for _ in range(count)] if strings is not None and not chat else []

    def chunk(index: int, d: TokenDelta, text: str | None = None, finish: str | None = None,
              call: tuple[int, dict[str, Any]] | None = None,
              token_logprobs: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any]:
        """One choice's chunk: the delta's text and finish (``text`` / ``finish`` given: those instead, as a tool
        parser decides), or one whole tool call (its id, name and complete arguments). ``token_logprobs`` given:
        those instead of the delta's (a tool parser's chunks carry each token's logprob once)."""
        text = d.text if text is None else text
        finish = d.finish_reason if finish is None else finish
        if chat:
            items = d.logprobs if token_logprobs is None else token_logprobs
            logprobs = None if strings is None else {"content": chat_content(items, strings)}
            delta: dict[str, Any] = {"content": text} if text else {}
            if call is not None:
                delta = {"tool_calls": [{"index": call[0], **call[1]}]}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            logprobs = offsets[index].add(d.logprobs) if offsets else None
            choice = {"index": index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        return {**base, "choices": [choice], **extra}

    if chat:
        for index in range(count):
            yield {**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra}
    elif echo is not None:
        plan, echoed = echo
        for index in range(count):
            yield {**base, "choices": [scoring.echo_chunk(index, echoed[index], plan, offsets[index] if offsets
                                                          else None)], **extra}
    # Tools: each choice's content as it comes, each call once its block is complete.
    parsers = [structured.ToolCallParser(tools.names) for _ in range(count)] if tools is not None else []
    calls_sent = [0] * count
    unsent: list[tuple[TokenLogprob, ...]] = [()] * count
    generated = cached = 0
    async with aclosing(deltas):
        async for c in deltas:
            d = c.delta
            generated += len(d.token_ids)
            cached += d.cached_tokens
            if not parsers:
                if d.text or d.finish_reason or d.logprobs:
                    yield chunk(c.index, d)
                continue
            parser = parsers[c.index]
            items = parser.feed(d.text) + (parser.finish(cut=d.finish_reason == "length") if d.finish_reason else [])
            # The parser may split a delta into several chunks or hold its text back: its tokens'
            # logprobs go out once, on the next chunk this choice sends.
            unsent[c.index] += d.logprobs
            for kind, value in items:
                sent, unsent[c.index] = unsent[c.index], ()
                if kind == "content":
                    yield chunk(c.index, d, text=value, finish=None, token_logprobs=sent)
                else:
                    yield chunk(c.index, d, text="", finish=None, call=(calls_sent[c.index], value),
                                token_logprobs=sent)
                    calls_sent[c.index] += 1
            if d.finish_reason:
                done = "tool_calls" if parser.calls and d.finish_reason == "stop" else d.finish_reason
                sent, unsent[c.index] = unsent[c.index], ()
                yield chunk(c.index, TokenDelta(text="", token_ids=[]), text="", finish=done, token_logprobs=sent)
    if spec.include_usage:
        yield {**base, "choices": [], "usage": _usage(n_prompt, generated, cached)}


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
