"""The per-engine scheduler for LLMs: admission queue in front of continuous batching.

The engine batches every admitted request per iteration; this queue bounds how
many are admitted (``max_running``), and times each request for the metrics.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence

import anyio

from headrace.batching.observer import NullObserver, SchedulerObserver
from headrace.plugins.protocols import LLMEngine, SamplingParams, TokenDelta


class LLMScheduler:
    def __init__(self, engine: LLMEngine, *, max_running: int, observer: SchedulerObserver | None = None) -> None:
        self.engine = engine
        self.name = engine.name
        self._slots = anyio.CapacityLimiter(max_running)
        self._observer = observer or NullObserver()
        self.waiting = 0

    @property
    def running(self) -> int:
        return self._slots.borrowed_tokens

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # admission needs no loop of its own

    async def prefill(self, ctx: str, tokens: Sequence[int], parent: str | None = None) -> None:
        """A prefill primitive: fills a context (a fork when ``parent`` is given)."""
        async with self._slots:
            await self.engine.prefill(ctx, tokens, parent)

    async def decode(self, ctx: str, params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """A decode primitive on a prefilled context; the context is freed when the iterator closes."""
        arrival = time.monotonic()
        generated = 0
        async with self._slots:
            self._observer.started(self.name, time.monotonic() - arrival)
            try:
                async for delta in self.engine.decode(ctx, params):
                    generated += len(delta.token_ids)
                    yield delta
            finally:
                await self.engine.free(ctx)
                self._observer.finished(self.name, time.monotonic() - arrival, 0, generated)

    async def free(self, ctx: str) -> None:
        await self.engine.free(ctx)

    async def generate(self, tokens: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Queue, then stream the engine's deltas. Close the iterator to abort the request."""
        arrival = time.monotonic()
        self.waiting += 1
        self._observer.queued(self.name)
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        generated = 0
        try:
            start = time.monotonic()
            self._observer.started(self.name, start - arrival)
            last = None
            async for delta in self.engine.generate(tokens, params):
                now = time.monotonic()
                if last is None:
                    self._observer.first_token(self.name, now - arrival)
                else:
                    self._observer.next_token(self.name, (now - last) / max(1, len(delta.token_ids)))
                last = now
                generated += len(delta.token_ids)
                yield delta
        finally:
            self._slots.release()
            self._observer.finished(self.name, time.monotonic() - arrival, len(tokens), generated)
