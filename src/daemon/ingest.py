"""``headrace ingest COLLECTION PATH...``: load text and markdown files into a running daemon's collection.

A client of the HTTP API like any other (httpx, as the bench harness): it creates the
collection when missing, then posts the files in batches to
``/v1/collections/{name}/documents``. A document's id is its path relative to the argument
that named it (a file named directly: its file name), so ingesting the same tree again
replaces each file's chunks instead of duplicating them. tqdm draws the progress bar: it is
already installed with transformers, and shows rate and time left without code of our own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

import httpx

# Read from a directory; a file named on the command line is read whatever its suffix.
TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".mdown", ".mkd", ".rst"})
BATCH_DOCUMENTS = 16  # documents per request: uploads overlap the daemon's embedding of the last batch
BATCH_BYTES = 1024 * 1024  # and at most this much text per request (the default body limit is 4 MiB)
TIMEOUT = httpx.Timeout(600.0, connect=10.0)  # a large batch embeds for a while on a CPU


class IngestError(Exception):
    """A problem to print as one line; ``status`` is the exit status (2: usage, nothing was sent)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Source:
    id: str
    path: Path


def find_files(paths: Iterable[str]) -> list[Source]:
    """Every file to ingest, in a stable order; a missing path is an error before anything is sent."""
    out: list[Source] = []
    for arg in paths:
        root = Path(arg)
        if root.is_file():
            out.append(Source(root.name, root))
        elif root.is_dir():
            for path in sorted(root.rglob("*")):
                rel = path.relative_to(root)
                if any(part.startswith(".") for part in rel.parts):  # .git, editor swap files...
                    continue
                if path.is_file() and path.suffix.lower() in TEXT_SUFFIXES:
                    out.append(Source(rel.as_posix(), path))
        else:
            raise IngestError(f"no such file or directory: {arg}")
    ids = [s.id for s in out]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise IngestError(f"two files would get the same document id {dupes[0]!r}; ingest them separately")
    return out


def _error(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


def _batches(docs: list[tuple[Source, str]]) -> Iterable[list[tuple[Source, str]]]:
    batch: list[tuple[Source, str]] = []
    size = 0
    for source, text in docs:
        n = len(text.encode())
        if batch and (len(batch) >= BATCH_DOCUMENTS or size + n > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append((source, text))
        size += n
    if batch:
        yield batch


def ingest(collection: str, paths: list[str], url: str, api_key: str | None, progress: bool = True) -> int:
    from tqdm import tqdm

    sources = find_files(paths)
    if not sources:
        raise IngestError(f"no text or markdown files in {' '.join(paths)}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    name = quote(collection, safe="")
    skipped = 0
    with httpx.Client(base_url=base, headers=headers, timeout=TIMEOUT) as client:
        try:
            r = client.get(f"/v1/collections/{name}")
        except httpx.HTTPError as exc:
            raise IngestError(f"cannot reach the daemon at {base}: {exc} (is `headrace serve` running? --url)") from None
        if r.status_code == 404 and r.json().get("error", {}).get("code") == "collection_not_found":
            r = client.post("/v1/collections", json={"name": collection})
            if r.status_code == 409:  # another client created it meanwhile
                r = client.get(f"/v1/collections/{name}")
        if r.status_code != 200:
            raise IngestError(f"collection {collection!r}: {_error(r)}")
        docs: list[tuple[Source, str]] = []
        for source in sources:
            try:
                text = source.path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                print(f"headrace ingest: skipped {source.path}: {exc}", file=sys.stderr)
                skipped += 1
                continue
            if not text.split():
                print(f"headrace ingest: skipped {source.path}: no text", file=sys.stderr)
                skipped += 1
                continue
            docs.append((source, text))
        chunks = ingested = 0
        with tqdm(total=len(docs), unit="file", desc=f"ingest {collection}", disable=not progress,
                  file=sys.stderr) as bar:
            for batch in _batches(docs):
                body: dict[str, Any] = {"documents": [{"id": s.id, "text": text} for s, text in batch]}
                try:
                    r = client.post(f"/v1/collections/{name}/documents", json=body)
                except httpx.HTTPError as exc:
                    raise IngestError(f"the daemon at {base} stopped answering: {exc}", status=1) from None
                if r.status_code != 200:
                    bar.write(f"headrace ingest: {', '.join(str(s.path) for s, _ in batch)}: {_error(r)}",
                              file=sys.stderr)
                    skipped += len(batch)
                else:
                    chunks += r.json()["chunks"]
                    ingested += len(batch)
                bar.update(len(batch))
    print(f"ingested {ingested} document(s), {chunks} chunk(s), into collection {collection!r}"
          + (f"; {skipped} file(s) skipped" if skipped else ""))
    return 1 if skipped else 0
