"""Persistent collections: /v1/collections (create, list, get, delete) and their documents.

A collection is indexed once and searched by many runs (``inputs.collection`` of the RAG
workflows). Documents are chunked by the workflows' own chunker, embedded through the embed
engine's scheduler (so concurrent uploads and runs batch together) and ingested through the
vector store's scheduler. Re-posting a document id replaces its chunks. The registry
(``headrace.daemon.collection_registry``) is saved under the data dir after every change, so
collections survive a restart; every change holds its lock, and the part that touches the
store and the registry is shielded from cancellation, so the two never disagree because a
client left or the drain ran out.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import anyio
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from headrace.batching.requests import EmbedRequest, VectorDrop, VectorIngest
from headrace.daemon import bodies as rq
from headrace.daemon.collection_kv import prefill_chunks
from headrace.daemon.collection_registry import Collection, CollectionRegistry, chunk_ids
from headrace.daemon.errors import APIError, bad_request
from headrace.daemon.headrace_schemas import AddDocumentsRequest, CreateCollectionRequest
from headrace.daemon.ownership import caller, read_only, readable
from headrace.daemon.services import daemon
from headrace.daemon.slots import EngineSlot
from headrace.graph.ops import chunk_text

log = logging.getLogger(__name__)


def _collection(request: Request, change: bool = False) -> Collection:
    """The collection in the path, if the caller may read it (another key's is 404, as a missing one);
    ``change``: and change it (a public one, made without a key, is read-only while keys are configured)."""
    name = request.path_params["collection"]
    collection = readable(request, daemon(request).collections.get(name))
    if collection is None:
        raise APIError(404, f"no collection named {name!r}", param="collection", code="collection_not_found")
    if change and read_only(request, collection):
        raise APIError(403, f"collection {name!r} is public (made without an API key): every key reads and "
                            "searches it, none changes it", param="collection", code="collection_read_only")
    return collection


def _slot(request: Request, name: str, kind: str, param: str | None) -> EngineSlot:
    """The ready engine ``name`` of ``kind``: 404 when unknown, 400 of another kind, 503 not ready."""
    slot = daemon(request).pool.slots.get(name)
    if slot is None:
        raise APIError(404, f"the model '{name}' does not exist", param=param, code="model_not_found")
    if slot.engine.kind != kind:
        raise bad_request(f"the model '{name}' is an engine of kind '{slot.engine.kind}', not '{kind}'",
                          param=param, code="model_not_supported")
    if slot.state != "ready" or slot.scheduler is None:
        raise APIError(503, f"the model '{name}' is {slot.state}, not ready", code="model_not_ready")
    return slot


def _default_engine(request: Request, kind: str, param: str) -> str:
    for slot in daemon(request).pool.slots.values():
        if slot.engine.kind == kind:
            return slot.name
    raise bad_request(f"no {kind} engine is configured; name one in '{param}'", param=param)


async def list_collections(request: Request) -> Response:
    collections = [c for c in daemon(request).collections.all() if readable(request, c) is not None]
    return JSONResponse({"object": "list", "data": [c.card() for c in collections]})


async def get_collection(request: Request) -> Response:
    return JSONResponse(_collection(request).card())


async def create_collection(request: Request) -> Response:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(CreateCollectionRequest, raw)
    if body.chunk_overlap >= body.chunk_size:
        raise bad_request("'chunk_overlap' must be smaller than 'chunk_size'", param="chunk_overlap")
    embed = body.embedding_model or _default_engine(request, "embed", "embedding_model")
    store = body.vector_store or _default_engine(request, "vector_store", "vector_store")
    _slot(request, embed, "embed", "embedding_model")
    store_slot = _slot(request, store, "vector_store", "vector_store")
    registry = daemon(request).collections
    async with registry.lock():
        if body.name in registry.collections:  # names are one namespace across keys (docs/deploy.md)
            raise APIError(409, f"a collection named {body.name!r} already exists", param="name",
                           code="collection_exists")
        collection = Collection(body.name, embed, store, body.chunk_size, body.chunk_overlap, owner=caller(request),
                                chunk_kv=body.chunk_kv)
        with anyio.CancelScope(shield=True):
            # A table left by a delete that crashed before its drop would hand its old rows
            # to the new collection: drop it first (dropping no table is no error).
            await store_slot.scheduler.submit(VectorDrop(collection.table), 1)
            registry.collections[body.name] = collection
            try:
                await registry.save()
            except BaseException:
                del registry.collections[body.name]
                raise
    return JSONResponse(collection.card())


async def delete_collection(request: Request) -> Response:
    registry = daemon(request).collections
    async with registry.lock():
        collection = _collection(request, change=True)
        with anyio.CancelScope(shield=True):
            # The registry first: a crash before the drop leaves only an orphan table, which
            # the next create of this name drops.
            del registry.collections[collection.name]
            try:
                await registry.save()
            except BaseException:
                registry.collections[collection.name] = collection
                raise
            try:
                store = _slot(request, collection.vector_store, "vector_store", None)
                await store.scheduler.submit(VectorDrop(collection.table), 1)
            except Exception:
                log.exception("collection %s: its table %s was not dropped (the next create of the name "
                              "drops it)", collection.name, collection.table)
    return JSONResponse({"id": collection.name, "object": "collection.deleted", "deleted": True})


async def add_documents(request: Request) -> Response:
    collection = _collection(request, change=True)
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(AddDocumentsRequest, raw)
    ids: list[str] = []
    seen: set[str] = set()
    for i, document in enumerate(body.documents):
        doc_id = document.id if document.id is not None else uuid.uuid4().hex
        if doc_id in seen:
            raise bad_request(f"document id {doc_id!r} appears twice in this request", param=f"documents[{i}].id",
                              code="duplicate_document")
        ids.append(doc_id)
        seen.add(doc_id)
    size = sum(len(d.text) for d in body.documents)
    chunks = await rq.off_loop_if_large(size, _chunk, [d.text for d in body.documents], collection)
    for i, pieces in enumerate(chunks):
        if not pieces:
            raise bad_request("the document has no words", param=f"documents[{i}].text")
    embed = _slot(request, collection.embedding_model, "embed", None)
    store = _slot(request, collection.vector_store, "vector_store", None)
    texts = [text for pieces in chunks for text in pieces]
    # Outside the lock: uploads to any collection embed concurrently, and batch with each other.
    vectors = await _embed(request, embed, texts)
    payloads = tuple(
        {"id": row_id, "text": text, "document": doc_id,
         **({"metadata": document.metadata} if document.metadata else {})}
        for doc_id, document, pieces in zip(ids, body.documents, chunks)
        for row_id, text in zip(chunk_ids(doc_id, len(pieces)), pieces)
    )
    registry = daemon(request).collections
    async with registry.lock():
        if registry.get(collection.name) is not collection:  # deleted (and maybe re-created) meanwhile
            raise APIError(404, f"collection {collection.name!r} was deleted while its documents were embedded",
                           param="collection", code="collection_not_found")
        with anyio.CancelScope(shield=True):
            await _replace(registry, collection, store, dict(zip(ids, map(len, chunks))), vectors, payloads)
        # Not shielded: an index is an optimisation, and one cut short is simply tried again next time.
        await _maybe_index(request, registry, collection, store)
    response = {"object": "collection.documents", "collection": collection.name, "ids": ids, "chunks": len(texts)}
    if collection.chunk_kv:  # after the lock: the documents are stored, and other uploads need not wait on this
        response["chunk_kv"] = await prefill_chunks(request, collection.name, texts)
    return JSONResponse(response)


async def delete_document(request: Request) -> Response:
    registry = daemon(request).collections
    doc_id = request.path_params["document_id"]
    async with registry.lock():
        collection = _collection(request, change=True)
        n = collection.documents.get(doc_id)
        if n is None:
            raise APIError(404, f"collection {collection.name!r} has no document {doc_id!r}", param="document_id",
                           code="document_not_found")
        store = _slot(request, collection.vector_store, "vector_store", None)
        with anyio.CancelScope(shield=True):
            # Rows first: a crash before the registry is saved leaves it naming rows already gone,
            # which a later delete or re-post of the id removes again without error.
            await store.engine.delete_rows(collection.table, chunk_ids(doc_id, n))
            del collection.documents[doc_id]
            await registry.save()
    return JSONResponse({"id": doc_id, "object": "collection.document.deleted", "deleted": True})


def _chunk(texts: list[str], collection: Collection) -> list[list[str]]:
    # The workflows' own chunker, so a collection's chunks are what a run would have indexed.
    return [chunk_text(text, collection.chunk_size, collection.chunk_overlap) for text in texts]


async def _embed(request: Request, slot: EngineSlot, texts: list[str]) -> torch.Tensor:
    """Every text's vector, submitted in pieces of the scheduler's batch size so they batch with
    other requests (one oversized request would run alone, as one huge engine call)."""
    size = daemon(request).config.batching_for(slot.name).max_batch_size
    pieces = [texts[i : i + size] for i in range(0, len(texts), size)]
    out: list[Any] = [None] * len(pieces)

    async def one(i: int, piece: list[str]) -> None:
        out[i] = await slot.scheduler.submit(EmbedRequest(tuple(piece)), len(piece))

    async with anyio.create_task_group() as tg:
        for i, piece in enumerate(pieces):
            tg.start_soon(one, i, piece)
    return torch.cat([v.float() for v in out])


async def _replace(registry: CollectionRegistry, collection: Collection, store: EngineSlot,
                   counts: dict[str, int], vectors: torch.Tensor, payloads: tuple[dict[str, Any], ...]) -> None:
    """Swap the documents' old chunks for the new ones; the registry always covers every row that may exist."""
    old = {doc_id: collection.documents.get(doc_id, 0) for doc_id in counts}
    # Recorded durably before the store changes: if the daemon dies midway, the registry still
    # names every row either version may have left, so a retry or a delete removes them all.
    for doc_id, n in counts.items():
        collection.documents[doc_id] = max(old[doc_id], n)
    await registry.save()
    stale = [row for doc_id, n in old.items() if n for row in chunk_ids(doc_id, n)]
    try:
        await store.engine.delete_rows(collection.table, stale)
    except BaseException:
        _restore(collection, old)  # nothing was deleted (LanceDB commits a delete at once or not at all)
        await registry.save()
        raise
    try:
        await store.scheduler.submit(VectorIngest(collection.table, vectors, payloads), len(payloads))
    except BaseException:
        # The old chunks are gone and the new ones never landed (one add, one commit): no document left.
        _restore(collection, {doc_id: 0 for doc_id in counts})
        await registry.save()
        raise
    collection.documents.update(counts)
    await registry.save()


def _restore(collection: Collection, counts: dict[str, int]) -> None:
    for doc_id, n in counts.items():
        if n:
            collection.documents[doc_id] = n
        else:
            collection.documents.pop(doc_id, None)


async def _maybe_index(request: Request, registry: CollectionRegistry, collection: Collection,
                       store: EngineSlot) -> None:
    """Build the ANN index once the collection reaches ``collections.ann_index_rows`` chunks."""
    threshold = daemon(request).config.collections.ann_index_rows
    build = getattr(store.engine, "build_vector_index", None)
    if collection.ann_index or not threshold or collection.chunks < threshold or build is None:
        return
    try:
        await build(collection.table)
    except Exception:  # searches stay exact (a scan): slower, never wrong; the next ingest tries again
        log.exception("collection %s: building its ANN index failed", collection.name)
        return
    collection.ann_index = True
    await registry.save()
