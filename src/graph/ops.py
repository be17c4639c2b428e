"""How each primitive runs: read its inputs from the run's scope, call its engine's scheduler.

Every engine call goes through the engine's scheduler with the node's
``PrimitiveMeta``, so schedulers and their policies see the primitive (run, node,
depth, task group, objective), not an anonymous request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import anyio
import torch

from headrace.batching.meta import Objective, PrimitiveMeta
from headrace.batching.resolved import ResolvedEngine
from headrace.batching.requests import EmbedRequest, RerankRequest, VectorIngest, VectorSearch, VectorSearchText
from headrace.graph.graph import LLM_MAX_TOKENS, Node, Op
from headrace.graph.parsers import make_parser
from headrace.graph.prompts import prompt_documents, prompt_tokens
from headrace.plugins.protocols import JsonSchemaConstraint, SamplingParams

class NodeError(RuntimeError):
    """A primitive failed; the message names the node and the cause."""


class NotRun(Exception):
    """A primitive chose not to run (an optional one, as an early prefill): its outputs are ``None``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class OpContext:
    run_id: str
    resolve: Callable[[str], ResolvedEngine]
    contexts: set[tuple[str, str]] = field(default_factory=set)  # (engine, ctx) to free when the run ends
    collections: set[tuple[str, str]] = field(default_factory=set)  # (engine, run's own table) to drop at its end
    on_piece: Callable[[Node, str, tuple], Awaitable[None]] | None = None
    on_delta: Callable[[Node, tuple, Any], Awaitable[None]] | None = None  # token deltas, for a streamed response
    policy: str | None = None
    alone: Any = None  # an isolated run's EngineTurns: one engine computes at a time
    arrival: float = field(default_factory=time.monotonic)  # the run's
    deadline: float | None = None
    objectives: Mapping[str, Objective] = field(default_factory=dict)  # node id -> objective
    task_groups: Mapping[str, str] = field(default_factory=dict)  # node id -> its task group, if any
    remaining: Mapping[str, float] = field(default_factory=dict)  # node id -> least seconds from its start to the run's end
    program: str | None = None  # the program the run belongs to across runs; None: the run is its program
    attained_tokens: int = 0  # that program's service before this run
    cache_partition: str = ""  # the cached KV the run's LLM calls may share (``PrimitiveMeta.cache_partition``)

    def meta(self, node: Node, key: tuple = ()) -> PrimitiveMeta:
        """What the engine's scheduler and its batch policy see: the primitive, not an anonymous request."""
        return PrimitiveMeta(
            run=self.run_id, node=node.id, key=key, depth=node.depth, task_group=self.task_groups.get(node.id),
            objective=self.objectives.get(node.id, "latency"), prefix_hash=node.prefix_hash,
            arrival=self.arrival, deadline=self.deadline, policy=self.policy, remaining=self.remaining.get(node.id),
            program=self.program, attained_tokens=self.attained_tokens, cache_partition=self.cache_partition,
        )

    def run_meta(self) -> PrimitiveMeta:
        """For a request the run makes outside any primitive (dropping its own table at its end)."""
        return PrimitiveMeta(run=self.run_id, arrival=self.arrival, deadline=self.deadline, policy=self.policy,
                             program=self.program, attained_tokens=self.attained_tokens,
                             cache_partition=self.cache_partition)


def chunk_text(docs: Any, size: int, overlap: int) -> list[str]:
    """Word windows of ``size`` with ``overlap`` words shared between neighbours."""
    docs = [docs] if isinstance(docs, str) else list(docs)
    step = max(1, size - overlap)
    chunks = []
    for doc in docs:
        words = doc.split()
        for start in range(0, max(1, len(words) - overlap), step):
            piece = " ".join(words[start : start + size])
            if piece:
                chunks.append(piece)
    return chunks


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


async def run_op(node: Node, scope: Mapping[str, Any], ctx: OpContext, key: tuple = ()) -> dict[str, Any]:
    """Execute one primitive; returns the values of its outputs."""
    handler = HANDLERS.get(node.op)
    if handler is None:
        raise NodeError(f"node {node.id!r}: {node.op} is run by the executor, not by an op handler")
    return await handler(node, scope, ctx, key)


def _engine(node: Node, ctx: OpContext) -> ResolvedEngine:
    if not node.engine:
        raise NodeError(f"node {node.id!r} ({node.op}) names no engine")
    return ctx.resolve(node.engine)


async def _chunk(node, scope, ctx, key):
    chunks = chunk_text(scope[node.inputs[0]], node.params.get("words", 256), node.params.get("overlap", 30))
    if "slice" in node.params:
        chunks = chunks[slice(*node.params["slice"])]
    return {node.outputs[0]: chunks}


async def _embed(node, scope, ctx, key):
    sched = _engine(node, ctx).batch()
    texts = _texts(scope[node.inputs[0]])
    if "slice" in node.params:
        texts = texts[slice(*node.params["slice"])]
    if not texts:
        return {node.outputs[0]: torch.empty(0, 0)}
    return {node.outputs[0]: await sched.submit(EmbedRequest(tuple(texts)), len(texts), ctx.meta(node, key))}


async def _ingest(node, scope, ctx, key):
    sched = _engine(node, ctx).batch()
    vectors, texts = scope[node.inputs[0]], _texts(scope[node.inputs[1]])
    if "slice" in node.params:
        texts = texts[slice(*node.params["slice"])]
    collection = node.params.get("collection")
    if not collection:  # the run's own table: recorded before the ingest, so even a failed one is dropped
        collection = f"run_{ctx.run_id}"
        ctx.collections.add((node.engine, collection))
    payloads = tuple({"text": t} for t in texts)
    await sched.submit(VectorIngest(collection, vectors, payloads), len(texts), ctx.meta(node, key))
    return {node.outputs[0]: collection}


def _dedupe(texts: list[str]) -> list[str]:
    return list(dict.fromkeys(texts))


async def _search(node, scope, ctx, key):
    sched = _engine(node, ctx).batch()
    vectors, collection = scope[node.inputs[0]], scope[node.inputs[1]]
    if vectors.dim() == 1:
        vectors = vectors.unsqueeze(0)
    if "slice" in node.params:  # a stage of a split search: its rows of the query vectors (a view)
        vectors = vectors[slice(*node.params["slice"])]
    if not len(vectors):
        return {node.outputs[0]: []}
    hits = await sched.submit(VectorSearch(collection, vectors, node.params.get("k", 3)), len(vectors),
                              ctx.meta(node, key))
    return {node.outputs[0]: _dedupe([h.payload["text"] for row in hits for h in row])}


async def _text_search(node, scope, ctx, key):
    sched = _engine(node, ctx).batch()
    collection = scope[node.inputs[1]] if len(node.inputs) > 1 else node.params["collection"]
    out = []
    for query in _texts(scope[node.inputs[0]]):
        hits = await sched.submit(VectorSearchText(collection, query, node.params.get("k", 3)), 1,
                                  ctx.meta(node, key))
        out.extend(h.payload["text"] for h in hits)
    return {node.outputs[0]: _dedupe(out)}


async def _rerank(node, scope, ctx, key):
    sched = _engine(node, ctx).batch()
    query, docs = str(scope[node.inputs[0]]), _texts(scope[node.inputs[1]])
    if "slice" in node.params:  # a stage of a split rerank: its share of the documents
        docs = docs[slice(*node.params["slice"])]
    if not docs:
        return {node.outputs[0]: []}
    meta = ctx.meta(node, key)
    scores = await sched.submit(RerankRequest(query, tuple(docs), meta), len(docs), meta)
    order = torch.argsort(scores.float(), descending=True, stable=True)[: node.params.get("top_n", 3)]
    if "stage" in node.params:  # scored, so that the stages' aggregate can pick the best over all of them
        return {node.outputs[0]: [(float(scores[i]), docs[i]) for i in order.tolist()]}
    return {node.outputs[0]: [docs[i] for i in order.tolist()]}


async def _prefill(node, scope, ctx, key):
    resolved = _engine(node, ctx)
    engine, sched = resolved.engine, resolved.llm()
    if node.op == Op.PARTIAL_PREFILL and sched.busy_with_other_runs(ctx.run_id):
        # An early prefill only pays with an idle engine: on one busy with other runs it would take
        # their turn for work this run's own prefill does later anyway (the prefill-split pass).
        raise NotRun("its engine is busy with other runs")
    part = {Op.PARTIAL_PREFILL: "prefix", Op.FULL_PREFILL: "rest"}.get(node.op, "all")
    parent = scope[node.params["parent"]] if node.op == Op.FULL_PREFILL else None
    if node.op == Op.FULL_PREFILL and parent is None:  # its early prefill did not run: the whole prompt
        part = "whole"
    documents: list[tuple[int, int]] = []  # the retrieved documents' spans, for an engine that places them
    # A request that arrives already tokenized (an OpenAI chat) carries its tokens.
    if "tokens" in node.params:
        tokens = node.params["tokens"]
    elif node.params.get("placed_documents") and part != "prefix" and sched.places_documents:
        tokens, documents = await anyio.to_thread.run_sync(prompt_documents, engine, node, scope, part)
    else:  # tokenizing a long prompt takes a while: off the event loop
        tokens = await anyio.to_thread.run_sync(prompt_tokens, engine, node, scope, part)
    context = engine.new_context_id()
    ctx.contexts.add((node.engine, context))
    await sched.prefill(context, tokens, parent, ctx.meta(node, key), documents)
    return {node.outputs[0]: context}


# A JSON item is a short text (a claim, a query): the bound makes a small model close each string,
# so items keep coming within the decode's token budget.
MAX_JSON_ITEM_CHARS = 160


def json_items_constraint(max_items: int | None) -> JsonSchemaConstraint:
    """A JSON array of non-empty strings (at most ``max_items``): what a "json" splittable decode must write."""
    schema: dict[str, Any] = {"type": "array", "items": {"type": "string", "minLength": 1,
                                                         "maxLength": MAX_JSON_ITEM_CHARS}, "minItems": 1}
    if max_items is not None:
        schema["maxItems"] = max_items
    return JsonSchemaConstraint(json.dumps(schema, separators=(",", ":")))


def sampling(node: Node) -> SamplingParams:
    if isinstance(node.params.get("sampling"), SamplingParams):
        return node.params["sampling"]
    # A decode split into JSON items is constrained to a JSON list of strings, so it parses by construction.
    constraint = json_items_constraint(node.params.get("max_pieces")) if node.splittable == "json" else None
    return SamplingParams(
        max_tokens=node.params.get("max_tokens", LLM_MAX_TOKENS),
        temperature=node.params.get("temperature", 0.0),
        top_p=node.params.get("top_p", 1.0),
        seed=node.params.get("seed"),
        stop=tuple(node.params.get("stop", ())),
        constraint=constraint,
    )


async def _decode(node, scope, ctx, key):
    sched = _engine(node, ctx).llm()
    context = scope[node.inputs[0]]
    parser = make_parser(node.splittable) if node.splittable else None
    pieces: list[str] = []
    text = []
    limit = node.params.get("max_pieces")  # enough pieces: stop decoding early

    async def emit(new: list[str]) -> None:
        for piece in new:
            if limit is not None and len(pieces) >= limit:
                return
            pieces.append(piece)
            if ctx.on_piece is not None and node.op == Op.PARTIAL_DECODE:
                await ctx.on_piece(node, piece, key + (len(pieces) - 1,))

    deltas = sched.decode(context, sampling(node), ctx.meta(node, key))
    try:
        async for delta in deltas:
            if ctx.on_delta is not None:
                await ctx.on_delta(node, key, delta)
            text.append(delta.text)
            if parser is not None:
                await emit(parser.feed(delta.text))
                if limit is not None and len(pieces) >= limit:
                    break
    finally:
        await deltas.aclose()
        ctx.contexts.discard((node.engine, context))
    if parser is not None:
        await emit(parser.finish())
        return {node.outputs[0]: pieces}
    return {node.outputs[0]: "".join(text).strip()}


async def _function(node, scope, ctx, key):
    result = node.params["fn"](*(scope[v] for v in node.inputs))
    if hasattr(result, "__await__"):
        result = await result
    # A function that feeds a region also has a "<id>.pieces" output, which the executor sets.
    outputs = [v for v in node.outputs if not v.endswith(".pieces")]
    if len(outputs) == 1:
        return {outputs[0]: result}
    return dict(zip(outputs, result, strict=True))


HANDLERS: dict[Op, Callable[..., Awaitable[dict[str, Any]]]] = {
    Op.CHUNK: _chunk,
    Op.EMBED: _embed,
    Op.INGEST: _ingest,
    Op.SEARCH: _search,
    Op.TEXT_SEARCH: _text_search,
    Op.RERANK: _rerank,
    Op.PREFILL: _prefill,
    Op.PARTIAL_PREFILL: _prefill,
    Op.FULL_PREFILL: _prefill,
    Op.DECODE: _decode,
    Op.PARTIAL_DECODE: _decode,
    Op.FUNCTION: _function,
}
