"""Persistent collections as runs see them: names, tables, and the lookup a run is checked with.

A collection ``docs`` is the vector-store table ``collection_docs``; runs' own tables are
``run_<id>``, so the prefix keeps a run's end-of-run drop off every collection. The registry
itself (settings, documents, counts) belongs to the daemon; the workflow service only gets a
``CollectionLookup`` from it, so a run that names an unknown collection is refused before it
starts, and its question is embedded by the engine that embedded the collection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from headrace.graph.workflow_errors import WorkflowInputError

# Letters, digits, '_' and '-', starting with a letter or digit: no path tricks, and a
# valid LanceDB table name once prefixed.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
TABLE_PREFIX = "collection_"


@dataclass(frozen=True)
class CollectionInfo:
    """What a run needs to know of a collection."""

    name: str
    engines: Mapping[str, str] = field(default_factory=dict)  # kind -> engine: "embed", "vector_store"
    chunks: int = 0


# (name, who asks: an API key's principal or None) -> the collection, or None when there is none
# by that name that they may read (another key's is as absent as a missing one)
CollectionLookup = Callable[[str, str | None], CollectionInfo | None]


class UnknownCollection(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"no collection named {self.name!r} (create it with POST /v1/collections)"


def check_name(name: str) -> str | None:
    """Why ``name`` is not a valid collection name, or None when it is."""
    if not NAME.match(name):
        return ("must be 1-64 letters, digits, '_' or '-', starting with a letter or digit, "
                f"got {name!r}")
    return None


def table_name(name: str) -> str:
    return TABLE_PREFIX + name


def source(inputs: dict[str, Any], documents: str) -> str:
    """Which of ``documents`` (an input to index in the run) and ``collection`` a run's inputs give.

    Exactly one is required; the error names the field as the schema would.
    """
    has_docs, has_collection = documents in inputs, "collection" in inputs
    if has_docs and has_collection:
        raise WorkflowInputError("inputs.collection", f"give either '{documents}' or 'collection', not both")
    if not has_docs and not has_collection:
        raise WorkflowInputError(f"inputs.{documents}", "required (or give 'collection')")
    if has_collection:
        problem = check_name(inputs["collection"])
        if problem:
            raise WorkflowInputError("inputs.collection", problem)
        return "collection"
    return documents
