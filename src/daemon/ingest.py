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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator
from urllib.parse import quote

import httpx

# Read from a directory; a file named on the command line is read whatever its suffix.
TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".mdown", ".mkd", ".rst"})
BATCH_DOCUMENTS = 16  # documents per request: uploads overlap the daemon's embedding of the last batch
BATCH_BYTES = 1024 * 1024  # and at most this much text per request (the default body limit is 4 MiB)
TIMEOUT = httpx.Timeout(3600.0, connect=10.0)  # a batch embeds and prefills its chunks (chunk_kv) a while


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
    dupes = sorted(i for i, n in Counter(s.id for s in out).items() if n > 1)
    if dupes:
        raise IngestError(f"two files would get the same document id {dupes[0]!r}; ingest them separately")
    return out


def _error(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


def _read(source: Source, warn) -> str | None:
    try:
        text = source.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        warn(f"headrace ingest: skipped {source.path}: {exc}")
        return None
    if not text.split():
        warn(f"headrace ingest: skipped {source.path}: no text")
        return None
    return text


def _batches(sources: list[Source], warn) -> Iterator[tuple[list[tuple[Source, str]], int]]:
    """(documents, files read) per request; files are read as their batch fills, not all up front."""
    batch: list[tuple[Source, str]] = []
    size = files = 0
    for source in sources:
        text = _read(source, warn)
        n = len(text.encode()) if text is not None else 0
        if batch and (len(batch) >= BATCH_DOCUMENTS or size + n > BATCH_BYTES):
            yield batch, files
            batch, size, files = [], 0, 0
        files += 1
        if text is not None:
            batch.append((source, text))
            size += n
    if files:
        yield batch, files


def _ensure_collection(client: httpx.Client, base: str, collection: str, settings: dict[str, Any]) -> None:
    name = quote(collection, safe="")
    try:
        r = client.get(f"/v1/collections/{name}")
    except httpx.HTTPError as exc:
        raise IngestError(f"cannot reach the daemon at {base}: {exc} (is `headrace serve` running? --url)") from None
    if r.status_code == 404 and _code(r) == "collection_not_found":
        r = client.post("/v1/collections", json={"name": collection, **settings})
        if r.status_code == 409:  # another client created it meanwhile
            r = client.get(f"/v1/collections/{name}")
            if r.status_code == 404:  # names are one namespace across keys (docs/deploy.md#what-each-api-key-owns)
                raise IngestError(f"collection {collection!r}: the name is taken by another API key's collection")
    if r.status_code != 200:
        raise IngestError(f"collection {collection!r}: {_error(r)}")


def _code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def ingest(collection: str, paths: list[str], url: str, api_key: str | None, progress: bool = True,
           settings: dict[str, Any] | None = None) -> int:
    """Post every file under ``paths``; ``settings`` (chunk_size...) apply only if the collection is created.

    Returns the exit status: 0, or 1 when a file was skipped or refused.
    """
    from tqdm import tqdm

    sources = find_files(paths)
    if not sources:
        raise IngestError(f"no text or markdown files in {' '.join(paths)}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    failed = chunks = ingested = 0
    with httpx.Client(base_url=base, headers=headers, timeout=TIMEOUT) as client:
        _ensure_collection(client, base, collection, {k: v for k, v in (settings or {}).items() if v is not None})
        with tqdm(total=len(sources), unit="file", desc=f"ingest {collection}", disable=not progress,
                  file=sys.stderr) as bar:

            def warn(message: str, files: int = 1) -> None:
                nonlocal failed
                failed += files
                bar.write(message, file=sys.stderr)  # above the bar, which stays whole

            for batch, files in _batches(sources, warn):
                if batch:
                    body = {"documents": [{"id": s.id, "text": text} for s, text in batch]}
                    try:
                        r = client.post(f"/v1/collections/{quote(collection, safe='')}/documents", json=body)
                    except httpx.HTTPError as exc:
                        raise IngestError(f"the daemon at {base} stopped answering: {exc}", status=1) from None
                    if r.status_code == 200:
                        chunks += r.json()["chunks"]
                        ingested += len(batch)
                    elif r.status_code == 503:  # draining or an engine down: every later batch would fail too
                        raise IngestError(f"the daemon at {base} cannot take documents now: {_error(r)}; "
                                          f"{ingested} document(s) were ingested before", status=1)
                    else:
                        warn(f"headrace ingest: {', '.join(str(s.path) for s, _ in batch)}: {_error(r)}", len(batch))
                bar.update(files)
    print(f"ingested {ingested} document(s), {chunks} chunk(s), into collection {collection!r}"
          + (f"; {failed} file(s) skipped or refused" if failed else ""))
    return 1 if failed else 0
