"""A queued request, as the schedulers and batch policies see it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import anyio


@dataclass(eq=False)
class Pending:
    """One request waiting for its engine: its payload, size in items, and metadata.

    ``meta`` carries what smarter policies look at (run, node, depth, task group).
    """

    payload: Any
    size: int
    meta: Mapping[str, Any] = field(default_factory=dict)
    arrival: float = field(default_factory=time.monotonic)
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None
    abandoned: bool = False  # its caller stopped waiting (cancelled): a retry skips it

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()
