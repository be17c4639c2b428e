"""A queued request, as the schedulers and batch policies see it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from headrace.batching.meta import PrimitiveMeta


@dataclass(eq=False)
class Pending:
    """One request waiting for its engine: its payload, size in items, and metadata.

    ``meta`` is what smarter policies look at (run, node, depth, task group); None
    for a request from outside any run.
    """

    payload: Any
    size: int
    meta: PrimitiveMeta | None = None
    arrival: float = field(default_factory=time.monotonic)
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None
    abandoned: bool = False  # its caller stopped waiting (cancelled): a retry skips it

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()
