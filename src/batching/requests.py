"""Typed requests for the batch-scheduled engines, and how a batch of them becomes engine calls.

The graph (and the daemon's retrieval routes) submit these to an engine's
``BatchScheduler``; ``runner_for`` gives the scheduler the function that runs a
batch. Embeds and reranks of many requests become one engine call; vector-store
requests already carry many vectors each, so they run one call each, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Sequence

from headrace.batching.meta import PrimitiveMeta
from headrace.plugins.protocols import EmbedEngine, Engine, RerankEngine, VectorStore

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EmbedRequest:
    kind: ClassVar[str] = "embed"
    texts: tuple[str, ...]


@dataclass(frozen=True)
class RerankRequest:
    kind: ClassVar[str] = "rerank"
    query: str
    docs: tuple[str, ...]
    # The primitive asking: an LLM reranker ranks its LLM call by the batch's most urgent one.
    meta: PrimitiveMeta | None = field(default=None, compare=False)


@dataclass(frozen=True)
class VectorIngest:
    kind: ClassVar[str] = "vector_store"
    collection: str
    vectors: "torch.Tensor"
    payloads: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class VectorSearch:
    kind: ClassVar[str] = "vector_store"
    collection: str
    vectors: "torch.Tensor"
    k: int


@dataclass(frozen=True)
class VectorSearchText:
    kind: ClassVar[str] = "vector_store"
    collection: str
    query: str
    k: int


@dataclass(frozen=True)
class VectorDrop:
    kind: ClassVar[str] = "vector_store"
    collection: str


VectorRequest = VectorIngest | VectorSearch | VectorSearchText | VectorDrop
EngineRequest = EmbedRequest | RerankRequest | VectorRequest


def runner_for(engine: Engine) -> Callable[[Sequence[EngineRequest]], Awaitable[list[Any]]]:
    """The scheduler's batch runner for ``engine``: requests in, one result per request out."""
    return partial(run_batch, engine)


async def run_batch(engine: Engine, requests: Sequence[EngineRequest]) -> list[Any]:
    # A request meant for another kind of engine fails (alone, once the scheduler bisects the batch).
    for request in requests:
        if getattr(request, "kind", None) != engine.kind:
            raise TypeError(f"engine {engine.name!r} ({engine.kind}) cannot serve a {type(request).__name__}")
    if engine.kind == "embed":
        return await _embed(engine, requests)
    if engine.kind == "rerank":
        return await _rerank(engine, requests)
    return [await _vector(engine, request) for request in requests]


async def _embed(engine: EmbedEngine, requests: Sequence[EmbedRequest]) -> list[Any]:
    vectors = await engine.embed([text for r in requests for text in r.texts])
    out, start = [], 0
    for r in requests:
        out.append(vectors[start : start + len(r.texts)])
        start += len(r.texts)
    return out


async def _rerank(engine: RerankEngine, requests: Sequence[RerankRequest]) -> list[Any]:
    """One ``score_pairs`` call per cache partition in the batch (mostly one): a reranker scoring through an LLM's
    prefix cache then reuses only its own partition's KV."""
    out: list[Any] = [None] * len(requests)
    by_partition: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by_partition.setdefault(r.meta.cache_partition if r.meta is not None else "", []).append(i)
    for indices in by_partition.values():
        group = [requests[i] for i in indices]
        metas = [r.meta for r in group if r.meta is not None]
        scores = await engine.score_pairs([(r.query, doc) for r in group for doc in r.docs], metas)
        start = 0
        for i, r in zip(indices, group):
            out[i] = scores[start : start + len(r.docs)]
            start += len(r.docs)
    return out


async def _vector(store: VectorStore, request: VectorRequest) -> Any:
    match request:
        case VectorIngest(collection, vectors, payloads):
            return await store.ingest(collection, vectors, payloads)
        case VectorSearch(collection, vectors, k):
            return await store.search(collection, vectors, k)
        case VectorSearchText(collection, query, k):
            return await store.search_text(collection, query, k)
        case VectorDrop(collection):
            return await store.drop(collection)
    raise TypeError(f"not a vector-store request: {type(request).__name__}")
