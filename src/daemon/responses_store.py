"""Stored responses (``/v1/responses`` with ``store``): one SQLite file in the data dir.

SQLite (the standard library's ``sqlite3``), not a LanceDB table: a response is a small record
fetched, written and deleted by its id, and expired by age, which is what a B-tree with a
transaction per change does; LanceDB is a columnar, append-versioned store for vector search,
where each delete writes a new table version to compact later. SQLite's file locking also lets
several daemons share one data dir, as the collections registry does; WAL mode lets a reader
go on while another daemon writes.

Each row holds the response as answered, the input items of its turn, and the conversation
before them (``context``: the items every earlier turn of its chain sent and answered), so a
continued response rebuilds its conversation from its predecessor alone, whatever became of
older turns. A row records the API key that made it (its principal; '' without keys); the routes
answer another key's response as a missing one (``headrace.daemon.ownership``). Rows older than ``max_age_seconds`` are not read,
and are deleted at the next write.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anyio

from headrace.daemon.config import ConfigError
from headrace.private_files import FILE_MODE, private_dir

FILE_NAME = "responses.sqlite3"
BUSY_SECONDS = 10.0  # how long a write waits for another daemon's transaction on the same file
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    program TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
"""


@dataclass
class StoredResponse:
    id: str
    owner: str | None
    created_at: float
    program: str  # the program its chain runs as (headrace.batching.programs): its successors join it
    response: dict[str, Any]  # the response object as answered
    input_items: list[dict[str, Any]]  # this turn's input, each item with its id
    context: list[dict[str, Any]]  # the conversation's items before this turn's input
    # The cache partition of a turn sent with a ``cache_salt`` (a digest, never the salt): a turn continuing it
    # without a salt of its own inherits it, so the chain keeps reusing its KV. "" for a turn sent without one.
    salted_partition: str = ""

    def conversation(self) -> list[dict[str, Any]]:
        """Every item a turn continuing this one follows: the context, this turn's input and its output."""
        return [*self.context, *self.input_items, *self.response["output"]]


class ResponsesStore:
    def __init__(self, data_dir: Path, max_age_seconds: float, clock: Callable[[], float] = time.time) -> None:
        self.path = data_dir / FILE_NAME
        self.max_age_seconds, self._clock = max_age_seconds, clock
        try:
            private_dir(data_dir)
            # Made 0600 before SQLite opens it: SQLite gives its -wal and -shm files the database file's mode.
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, FILE_MODE))
            with closing(self._connect()) as db, db:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            # Refuse to start rather than serve a store we cannot read (as the collections registry does).
            raise ConfigError("data.dir", f"{self.path} is not a usable responses store: {exc}") from None

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=BUSY_SECONDS)

    def _cutoff(self) -> float:
        return self._clock() - self.max_age_seconds

    async def put(self, stored: StoredResponse) -> None:
        record = json.dumps({"response": stored.response, "input_items": stored.input_items,
                             "context": stored.context, "salted_partition": stored.salted_partition},
                            ensure_ascii=False)
        await anyio.to_thread.run_sync(self._put, stored, record)

    def _put(self, stored: StoredResponse, record: str) -> None:
        with closing(self._connect()) as db, db:  # one transaction: the expired rows go as the new one comes
            db.execute("DELETE FROM responses WHERE created_at < ?", (self._cutoff(),))
            db.execute("INSERT INTO responses (id, owner, created_at, program, record) VALUES (?, ?, ?, ?, ?)",
                       (stored.id, stored.owner or "", stored.created_at, stored.program, record))

    async def get(self, response_id: str) -> StoredResponse | None:
        """The response stored under ``response_id``, whoever's; None when missing or expired."""
        return await anyio.to_thread.run_sync(self._get, response_id)

    def _get(self, response_id: str) -> StoredResponse | None:
        with closing(self._connect()) as db:
            row = db.execute("SELECT owner, created_at, program, record FROM responses WHERE id = ? "
                             "AND created_at >= ?", (response_id, self._cutoff())).fetchone()
        if row is None:
            return None
        record = json.loads(row[3])
        return StoredResponse(response_id, row[0] or None, row[1], row[2], record["response"], record["input_items"],
                              record["context"], record.get("salted_partition", ""))

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """Delete ``owner``'s response; False when there was none to delete (the owner is checked again
        here, in the same statement, so a row is never deleted under another key's name)."""
        return await anyio.to_thread.run_sync(self._delete, response_id, owner or "")

    def _delete(self, response_id: str, owner: str) -> bool:
        with closing(self._connect()) as db, db:
            gone = db.execute("DELETE FROM responses WHERE id = ? AND owner = ? AND created_at >= ?",
                              (response_id, owner, self._cutoff())).rowcount
        return gone > 0
