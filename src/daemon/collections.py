"""The registry of persistent collections: a small JSON file in the data dir.

The chunks themselves live in the vector store (one table per collection, see
``headrace.graph.collections``); the registry records each collection's settings
and, per document, how many chunks it made (chunk ``i`` of document ``d`` is the
row ``d:i``), so a document can be replaced or deleted by id and the listing has
counts without scanning tables. It is rewritten atomically (a temporary file
renamed over it), so a crash leaves the old or the new file, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

from headrace.daemon.config import ConfigError
from headrace.graph.collections import CollectionInfo, table_name

FILE_NAME = "collections.json"
VERSION = 1


@dataclass
class Collection:
    name: str
    embedding_model: str
    vector_store: str
    chunk_size: int
    chunk_overlap: int
    created: int = field(default_factory=lambda: int(time.time()))
    documents: dict[str, int] = field(default_factory=dict)  # document id -> its number of chunks
    ann_index: bool = False  # its table has an ANN index (built once past collections.ann_index_rows)

    @property
    def table(self) -> str:
        return table_name(self.name)

    @property
    def chunks(self) -> int:
        return sum(self.documents.values())

    def card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "collection", "embedding_model": self.embedding_model,
                "vector_store": self.vector_store, "chunk_size": self.chunk_size,
                "chunk_overlap": self.chunk_overlap, "created": self.created,
                "documents": len(self.documents), "chunks": self.chunks,
                "ann_index": self.ann_index}

    def info(self) -> CollectionInfo:
        return CollectionInfo(self.name, {"embed": self.embedding_model, "vector_store": self.vector_store},
                              self.chunks)


def chunk_ids(document_id: str, n: int) -> list[str]:
    # Unambiguous: the index after the last ':' is an integer, the document id is what precedes it.
    return [f"{document_id}:{i}" for i in range(n)]


class CollectionRegistry:
    """Collections by name, persisted to ``<data dir>/collections.json``; ``lock`` serialises every change."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / FILE_NAME
        self.lock = anyio.Lock()
        self.collections: dict[str, Collection] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.collections = {name: Collection(**entry) for name, entry in data["collections"].items()}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # Refuse to start rather than serve (and later overwrite) a registry we cannot read.
                raise ConfigError("data.dir", f"{self.path} is not a readable collections registry: "
                                              f"{type(exc).__name__}: {exc}") from None

    def get(self, name: str) -> Collection | None:
        return self.collections.get(name)

    def lookup(self, name: str) -> CollectionInfo | None:
        """For the workflow service: a run on ``name`` is checked against this."""
        collection = self.collections.get(name)
        return collection.info() if collection is not None else None

    async def save(self) -> None:
        data = {"version": VERSION, "collections": {name: asdict(c) for name, c in self.collections.items()}}
        await anyio.to_thread.run_sync(_write_atomically, self.path, json.dumps(data, indent=1))


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename is durable only once the directory entry is: fsync the directory too.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
