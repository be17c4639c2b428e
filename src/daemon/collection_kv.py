"""A collection's chunks prefilled on the LLM at ingest (issue 49, part 1): ``headrace.graph.chunk_kv`` says which
prefixes; this sends them through the LLM's scheduler and frees each context at once, so its KV stays only in
the engine's prefix cache, and from there in its KV tiers (host memory, disk) once the cells need the room. On an
engine that places documents (``place_documents``), each chunk's KV is also computed alone, for placement at any
position of a prompt (part 2). And the default reranker, where it reads the document first and scores through its
LLM's prefix cache (``WarmsDocuments``: ``llm-rerank``'s default), scores each chunk once, so a run's first rerank
of it restores it too.

The prefixes are cached in the ingesting key's partition (``cache_partition``): a run of that key (or of any
key, where keys share caches) finds them, another key's run does not. The engine is the first LLM, the one a
workflow uses by default; a run on another LLM finds nothing and prefills as before.

An optimisation, never a condition of the ingest: the documents are in the store before this starts, and a
failure here is logged and reported in the response, not raised.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import anyio
from starlette.requests import Request

from headrace.batching.meta import PrimitiveMeta
from headrace.daemon.cache_partition import cache_partition
from headrace.daemon.services import daemon
from headrace.graph.chunk_kv import chunk_prompts, template_heads
from headrace.plugins.protocols import WarmsDocuments

log = logging.getLogger(__name__)

# Prefills in flight at once: enough to batch in the engine's iterations, few enough to leave it contexts
# (and cells) for the requests being served meanwhile.
CONCURRENT_PREFILLS = 4


async def prefill_chunks(request: Request, collection: str, texts: list[str]) -> dict[str, Any]:
    """Prefill every chunk-first prompt of ``texts`` on the default LLM; what was done, for the response."""
    name = daemon(request).pool.engines_by_kind().get("llm")
    if name is None:
        return {"skipped": "no LLM engine is ready"}
    resolved = daemon(request).pool.resolve(name)
    engine, sched = resolved.engine, resolved.llm()
    caching = getattr(engine, "prefix_caching_enabled", None)
    if caching is None or not caching():
        return {"model": name, "skipped": "the engine keeps no prefix cache"}
    start = time.perf_counter()
    def tokenize() -> list[list[int]]:
        heads = template_heads(engine)
        return [p for text in texts for p in chunk_prompts(engine, text, heads)]

    prompts = await anyio.to_thread.run_sync(tokenize)
    # Ranked as bulk work: a query being served meanwhile goes first.
    meta = PrimitiveMeta(run=f"ingest-{uuid.uuid4().hex[:12]}", objective="throughput",
                         cache_partition=cache_partition(request, None, engine))
    limiter = anyio.CapacityLimiter(CONCURRENT_PREFILLS)

    async def one(tokens: list[int]) -> None:
        async with limiter:
            ctx = engine.new_context_id()
            try:
                await sched.prefill(ctx, tokens, None, meta)
            finally:
                with anyio.CancelScope(shield=True):
                    await sched.free(ctx)

    try:
        async with anyio.create_task_group() as tg:
            for tokens in prompts:
                tg.start_soon(one, tokens)
    except Exception as exc:  # the documents are ingested already: say so, and what failed
        log.exception("collection %s: prefilling its chunks' KV on %s failed", collection, name)
        return {"model": name, "error": f"{type(exc).__name__}: {exc}"}
    done: dict[str, Any] = {"model": name, "prompts": len(prompts), "tokens": sum(map(len, prompts))}
    if sched.places_documents:
        try:
            done["documents_placeable"] = await prepare_documents(engine, sched, texts, meta)
        except Exception as exc:
            log.exception("collection %s: computing its chunks' KV for placement on %s failed", collection, name)
            done["documents_error"] = f"{type(exc).__name__}: {exc}"
    judged = await warm_judge(request, collection, texts, meta)
    if judged is not None:
        done["rerank"] = judged
    done["seconds"] = round(time.perf_counter() - start, 3)
    return done


async def warm_judge(request: Request, collection: str, texts: list[str], meta: PrimitiveMeta) -> dict[str, Any] | None:
    """Each chunk scored once by the default reranker where it reads the document first (``WarmsDocuments``), so a
    run's first rerank of the chunk restores it from the LLM's prefix cache; what was done, or None (no such
    reranker)."""
    name = daemon(request).pool.engines_by_kind().get("rerank")
    if name is None:
        return None
    judge = daemon(request).pool.resolve(name).engine
    if not isinstance(judge, WarmsDocuments) or not judge.warms_documents:
        return None
    start = time.perf_counter()
    try:
        documents = await judge.warm_documents(texts, [meta])
    except Exception as exc:
        log.exception("collection %s: scoring its chunks ahead on %s failed", collection, name)
        return {"engine": name, "error": f"{type(exc).__name__}: {exc}"}
    return {"engine": name, "documents": documents, "seconds": round(time.perf_counter() - start, 3)}


async def prepare_documents(engine: Any, sched: Any, texts: list[str], meta: PrimitiveMeta) -> int:
    """Each chunk's KV computed alone, for placement at any position of a prompt (``PlacesDocuments``); how many
    the engine holds. One chunk a command: the engine's worker computes it between its iterations, so requests
    being served wait at most one chunk's prefill."""
    docs = await anyio.to_thread.run_sync(lambda: [list(engine.encode(text)) for text in texts])
    return sum([await sched.prepare_documents([doc], meta) for doc in docs])
