"""How a scheduler keeps its engine loaded while work runs on it.

Under a memory budget the daemon may unload an engine that has nothing in flight; a
scheduler wraps each batch (and each LLM request) in ``hold()``, which waits while the
engine loads (evicting others) and keeps it loaded until the block ends. Requests queued
on the scheduler meanwhile stay queued: an unloaded engine's queue waits for its reload.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import AsyncIterator, Protocol, runtime_checkable


class EngineUnavailable(RuntimeError):
    """``hold`` could not load the engine (its load failed, or no room was made for it in time)."""


@runtime_checkable
class Residency(Protocol):
    def hold(self) -> AbstractAsyncContextManager[None]:
        """Enter once the engine is loaded (loading it if need be); it stays loaded until the block exits.

        Raises ``EngineUnavailable`` when it cannot be loaded."""
        ...


class AlwaysResident:
    """An engine that is never unloaded (no budget, or a scheduler used on its own)."""

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        yield
