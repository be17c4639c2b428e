"""Vector store on embedded LanceDB (plugin kind ``lancedb``).

One table per collection: ``id`` string, ``vector`` fixed-size float32 list,
``text`` string (the payload's "text", full-text indexed) and ``payload`` (the
whole payload as JSON). Vector search is exact under the cosine metric until
``build_vector_index`` gives a table an ANN index (the daemon does, for a
persistent collection past ``collections.ann_index_rows``); full-text search
uses LanceDB's native BM25 index.

Options: ``path`` (default ``<data_dir>/lancedb``), ``fts_reindex_rows``
(fold new rows into the FTS index once this many are unindexed, default 256;
until then LanceDB scans them directly, so they are searchable at once),
``index_cache_mib`` (256) and ``metadata_cache_mib`` (64): the bounds of the
LanceDB session's caches. Its defaults (6 GiB and 1 GiB) let the metadata
cache grow by ~17 KiB with every replace (a delete and an add: two table
versions), for hours in a daemon that keeps ingesting; bounded, it holds what
the live versions need.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import anyio
import torch

from headrace.plugins.engines.retrieval.handoff import HandoffStats, arrow_vectors, float32_rows, numpy_rows
from headrace.plugins.hookspecs import hookimpl
from headrace.plugins.protocols import EngineEnv, EngineSpec, SearchHit
from headrace.private_files import private_dir

# LanceDB's own rule for table names, checked up front for a clearer message.
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class CollectionNotFound(KeyError):
    """A search named a collection that nothing was ever ingested into."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class LanceDBStore:
    """A ``VectorStore``: every LanceDB call runs on one worker thread at a time."""

    kind = "vector_store"

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.name = spec.name
        self._env = env
        self.path = Path(spec.options.get("path") or env.data_dir / "lancedb").expanduser()
        self._reindex_rows = int(spec.options.get("fts_reindex_rows", 256))
        key = f"engines.{spec.name}.options"
        self._cache_bytes = {name: _mebibytes(spec.options.get(name, default), f"{key}.{name}")
                             for name, default in (("index_cache_mib", 256), ("metadata_cache_mib", 64))}
        self._session: Any = None
        # The sync lancedb API is not meant for concurrent writers; serialise.
        self._limiter = anyio.CapacityLimiter(1)
        self._db: Any = None
        self._tables: dict[str, Any] = {}
        # Vectors arrive from the embedder by reference; what had to be copied is counted here.
        self.handoff = HandoffStats()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            self._db = await anyio.to_thread.run_sync(self._connect, limiter=self._limiter)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            self._tables.clear()
            self._db = None

    def _connect(self) -> Any:
        import lancedb

        private_dir(self.path)  # its files are 0600 by the daemon's umask (headrace.private_files)
        self._session = lancedb.Session(index_cache_size_bytes=self._cache_bytes["index_cache_mib"],
                                        metadata_cache_size_bytes=self._cache_bytes["metadata_cache_mib"])
        return lancedb.connect(str(self.path), session=self._session)

    async def _call(self, fn: Any, *args: Any, observe: tuple[str, int] | None = None) -> Any:
        if self._db is None:
            raise RuntimeError(f"vector store {self.name!r} is not running")
        if observe is None:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        async with self._limiter:  # time the call from when the worker thread is ours
            start = time.monotonic()
            result = await anyio.to_thread.run_sync(fn, *args)
            self._env.observe_batch(*observe, start, time.monotonic())
        return result

    # ----- public API -------------------------------------------------------------

    async def ingest(self, collection: str, vectors: torch.Tensor, payloads: Sequence[dict[str, Any]]) -> list[str]:
        _check_name(collection)
        matrix = _as_matrix(vectors)
        if matrix.shape[0] != len(payloads):
            raise ValueError(f"ingest: {matrix.shape[0]} vectors but {len(payloads)} payloads")
        if not payloads:
            return []
        matrix = float32_rows(matrix, self.handoff)
        rows = _rows(matrix, payloads)
        return await self._call(self._ingest, collection, matrix.shape[1], rows, observe=("ingest", len(payloads)))

    async def search(self, collection: str, vectors: torch.Tensor, k: int) -> list[list[SearchHit]]:
        matrix = _as_matrix(vectors)
        if k < 1:
            raise ValueError("k must be >= 1")
        matrix = float32_rows(matrix, self.handoff)
        return await self._call(self._search, collection, matrix, k, observe=("search", matrix.shape[0]))

    def stats(self) -> dict[str, int]:
        session = self._session
        return {**self.handoff.as_dict(), "store_cache_bytes": 0 if session is None else session.size_bytes}

    async def drop(self, collection: str) -> None:
        """Delete a collection and its rows; dropping one that does not exist is no error."""
        _check_name(collection)
        await self._call(self._drop, collection)

    async def delete_rows(self, collection: str, ids: Sequence[str]) -> None:
        """Delete the rows with these ids (absent ones, or an absent collection, are no error)."""
        _check_name(collection)
        if ids:
            await self._call(self._delete_rows, collection, list(ids))

    async def build_vector_index(self, collection: str) -> bool:
        """Give the collection's vectors an ANN index unless it has one; True when one was built."""
        _check_name(collection)
        return await self._call(self._build_vector_index, collection)

    async def has_vector_index(self, collection: str) -> bool:
        _check_name(collection)
        return await self._call(lambda: _vector_index_name(self._table(collection)) is not None)

    async def search_text(self, collection: str, query: str, k: int) -> list[SearchHit]:
        if k < 1:
            raise ValueError("k must be >= 1")
        if not query.strip():
            return []
        return await self._call(self._search_text, collection, query, k, observe=("search_text", 1))

    # ----- worker-thread side -----------------------------------------------------------

    def _table(self, collection: str) -> Any:
        table = self._tables.get(collection)
        if table is None:
            try:
                table = self._db.open_table(collection)
            except ValueError:  # lancedb 0.40: "Table '<name>' was not found"
                raise CollectionNotFound(
                    f"vector store {self.name!r} has no collection {collection!r}; ingest into it first"
                ) from None
            self._tables[collection] = table
        return table

    def _drop(self, collection: str) -> None:
        self._tables.pop(collection, None)
        # A run that failed before its ingest never created its table.
        self._db.drop_table(collection, ignore_missing=True)

    def _delete_rows(self, collection: str, ids: list[str]) -> None:
        try:
            table = self._table(collection)
        except CollectionNotFound:
            return
        quoted = ", ".join("'" + row_id.replace("'", "''") + "'" for row_id in ids)  # SQL string literals
        table.delete(f"id IN ({quoted})")

    def _build_vector_index(self, collection: str) -> bool:
        from lancedb.index import IvfHnswSq

        table = self._table(collection)
        if _vector_index_name(table) is not None:
            return False
        # IVF-HNSW-SQ: HNSW graphs keep recall high at any size, 8-bit scalar quantization
        # cuts the index to a quarter of the float32 vectors, and (unlike PQ, which trains
        # 256 centroids per sub-vector) it trains on a table of any size. LanceDB advises few
        # partitions for HNSW; one per million rows keeps each graph a manageable build.
        # Searches pass the same cosine metric (``_search``): an index trained on another
        # metric would answer wrongly. Rows added later are scanned exactly until
        # ``optimize()`` (see ``_refresh_fts``) folds them into the index.
        partitions = max(1, table.count_rows() // 1_000_000)
        table.create_index("vector", config=IvfHnswSq(distance_type="cosine", num_partitions=partitions),
                           replace=False)
        return True

    def _ingest(self, collection: str, dim: int, rows: Any) -> list[str]:
        try:
            table = self._table(collection)
        except CollectionNotFound:
            table = self._create(collection, dim, rows)
            return rows.column("id").to_pylist()
        _check_dim(collection, _table_dim(table), dim)
        table.add(rows)
        self._refresh_fts(table)
        return rows.column("id").to_pylist()

    def _create(self, collection: str, dim: int, rows: Any) -> Any:
        from lancedb.index import FTS

        table = self._db.create_table(collection, data=rows, schema=_schema(dim))
        # Native (non-Tantivy) inverted index; lancedb 0.40 removed Tantivy FTS.
        table.create_index("text", config=FTS(), replace=True)
        self._tables[collection] = table
        return table

    def _refresh_fts(self, table: Any) -> None:
        # Unindexed rows are still found (LanceDB scans them), just more slowly;
        # optimize() folds them into the index, but it also compacts the data
        # files, so run it in batches rather than after every small ingest.
        name = _fts_index_name(table)
        if name is None:  # a table made outside headrace, say
            from lancedb.index import FTS

            table.create_index("text", config=FTS(), replace=True)
            return
        stats = table.index_stats(name)
        if stats is not None and stats.num_unindexed_rows >= self._reindex_rows:
            table.optimize()

    def _search(self, collection: str, matrix: torch.Tensor, k: int) -> list[list[SearchHit]]:
        table = self._table(collection)
        _check_dim(collection, _table_dim(table), matrix.shape[1])
        results = []
        for query in numpy_rows(matrix):  # each a view of one row: LanceDB reads the embedder's memory
            rows = (
                table.search(query, vector_column_name="vector")
                .distance_type("cosine")
                .select(["id", "payload", "_distance"])
                .limit(k)
                .to_list()
            )
            # LanceDB's cosine distance is 1 - cosine similarity.
            results.append([_hit(row, 1.0 - float(row["_distance"])) for row in rows])
        return results

    def _search_text(self, collection: str, query: str, k: int) -> list[SearchHit]:
        table = self._table(collection)
        rows = (
            table.search(query, query_type="fts", fts_columns="text")
            .select(["id", "payload", "_score"])
            .limit(k)
            .to_list()
        )
        return [_hit(row, float(row["_score"])) for row in rows]


# ----- helpers ------------------------------------------------------------------------


def _check_name(collection: str) -> None:
    if not _NAME.match(collection):
        raise ValueError(f"collection name {collection!r} may only contain letters, digits, '_', '-' and '.'")


def _as_matrix(vectors: torch.Tensor) -> torch.Tensor:
    matrix = torch.as_tensor(vectors).detach()  # float32 on the host: float32_rows, which counts a copy
    if matrix.ndim == 1:
        matrix = matrix.unsqueeze(0)
    if matrix.ndim != 2 or matrix.shape[1] == 0:
        raise ValueError(f"vectors must have shape (n, dim), got {tuple(matrix.shape)}")
    return matrix


def _check_dim(collection: str, expected: int, got: int) -> None:
    if expected != got:
        raise ValueError(f"collection {collection!r} holds {expected}-dimensional vectors, got {got}-dimensional")


def _table_dim(table: Any) -> int:
    return table.schema.field("vector").type.list_size


def _vector_index_name(table: Any) -> str | None:
    for index in table.list_indices():
        if "vector" in index.columns and index.index_type != "FTS":
            return index.name
    return None


def _fts_index_name(table: Any) -> str | None:
    for index in table.list_indices():
        if index.index_type == "FTS":
            return index.name
    return None


def _schema(dim: int) -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), dim)),
            pa.field("text", pa.string()),
            pa.field("payload", pa.string()),
        ]
    )


def _rows(matrix: torch.Tensor, payloads: Sequence[dict[str, Any]]) -> Any:
    """The rows to write as an Arrow table whose vector column is the matrix's own memory."""
    import pyarrow as pa

    ids = [str(p["id"]) if p.get("id") is not None else uuid.uuid4().hex for p in payloads]
    texts = [t if isinstance(t := p.get("text"), str) else None for p in payloads]
    columns = [pa.array(ids, pa.string()), arrow_vectors(matrix), pa.array(texts, pa.string()),
               pa.array([json.dumps(p) for p in payloads], pa.string())]
    return pa.Table.from_arrays(columns, schema=_schema(matrix.shape[1]))


def _hit(row: dict[str, Any], score: float) -> SearchHit:
    return SearchHit(id=row["id"], score=score, payload=json.loads(row["payload"]))


def _mebibytes(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: must be an integer >= 1 (MiB), not {value!r}")
    return value << 20


def factory(spec: EngineSpec, env: EngineEnv) -> LanceDBStore:
    return LanceDBStore(spec, env)


@hookimpl
def register_engines(register):
    register("lancedb", factory)
