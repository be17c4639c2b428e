"""The registry of persistent collections: a small JSON file in the data dir.

The chunks themselves live in the vector store (one table per collection, see
``headrace.graph.collection_refs``); the registry records each collection's settings
and, per document, how many chunks it made (chunk ``i`` of document ``d`` is the
row ``d:i``), so a document can be replaced or deleted by id and the listing has
counts without scanning tables. It is rewritten atomically (a temporary file
renamed over it), so a crash leaves the old or the new file, never half of one.

Several daemons may share one data dir (headrace-ray's replicas on one node, or on a shared
mount): each reads the file again when it changed on disk, and ``lock`` also holds a lock
file, so one daemon's change is made on the others' latest and never overwrites theirs.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from filelock import FileLock, Timeout

from headrace.daemon.config import ConfigError
from headrace.daemon.ownership import may_read
from headrace.graph.collection_refs import CollectionInfo, table_name
from headrace.private_files import FILE_MODE, private_dir

FILE_NAME = "collections.json"
VERSION = 1
LOCK_POLL_SECONDS = 0.01  # how often a daemon retries the lock file another daemon holds


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
    owner: str | None = None  # the API key's principal that made it; None: public (headrace.daemon.ownership)
    # Its chunks' KV prefilled at ingest for the RAG workflows' chunk-first prompts (``headrace.graph.chunk_kv``).
    chunk_kv: bool = True

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
                "ann_index": self.ann_index, "chunk_kv": self.chunk_kv}

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
        self._lock = anyio.Lock()
        self._file_lock = FileLock(str(self.path) + ".lock", mode=FILE_MODE)  # the other daemons on this data dir
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) of the file as last read or written
        self.collections: dict[str, Collection] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the file again if another daemon changed it. A collection that is still there keeps its
        object (updated in place), so a request holding it sees the change."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        # Every save renames a new file over it: a new inode, even within one mtime tick.
        if (stat.st_ino, stat.st_mtime_ns, stat.st_size) == self._seen:
            return
        try:
            data = json.loads(self.path.read_text())
            latest = {name: Collection(**entry) for name, entry in data["collections"].items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Refuse to start rather than serve (and later overwrite) a registry we cannot read.
            raise ConfigError("data.dir", f"{self.path} is not a readable collections registry: "
                                          f"{type(exc).__name__}: {exc}") from None
        for name, collection in latest.items():
            mine = self.collections.get(name)
            if mine is not None and mine.created == collection.created:
                mine.__dict__.update(collection.__dict__)
                latest[name] = mine
        self.collections = latest
        self._seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    @asynccontextmanager
    async def lock(self) -> AsyncIterator[None]:
        """Held around every change: this daemon's tasks one at a time, other daemons' through the lock file;
        the change then starts from the file's latest state."""
        async with self._lock:
            private_dir(self.path.parent)
            while True:  # polled, not a blocking acquire on a thread, so a cancelled wait ends at once
                try:
                    self._file_lock.acquire(blocking=False)
                    break
                except Timeout:
                    await anyio.sleep(LOCK_POLL_SECONDS)
            try:
                self.refresh()
                yield
            finally:
                self._file_lock.release()

    def get(self, name: str) -> Collection | None:
        self.refresh()
        return self.collections.get(name)

    def all(self) -> list[Collection]:
        self.refresh()
        return sorted(self.collections.values(), key=lambda c: c.name)

    def lookup(self, name: str, who: str | None) -> CollectionInfo | None:
        """For the workflow service: a run on ``name`` is checked against this; another key's collection
        is as absent as a missing one."""
        collection = self.get(name)
        return collection.info() if collection is not None and may_read(collection.owner, who, public=True) else None

    async def save(self) -> None:
        data = {"version": VERSION, "collections": {name: asdict(c) for name, c in self.collections.items()}}
        self._seen = await anyio.to_thread.run_sync(_write_atomically, self.path, json.dumps(data, indent=1))


def _write_atomically(path: Path, text: str) -> tuple[int, int, int]:
    """Write ``text`` over ``path`` durably; returns the new file's (inode, mtime_ns, size)."""
    private_dir(path.parent)
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
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns, stat.st_size
