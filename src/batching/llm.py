"""The per-engine scheduler for LLMs: admission queue in front of continuous batching.

The engine batches every admitted request per iteration; this queue bounds how
many are admitted (``max_running``) and times each request for the metrics:
queue time, time to first token (from the prefill's arrival), inter-token
latency and end-to-end latency.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
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
        self._arrivals: dict[str, tuple[float, int]] = {}  # ctx -> (prefill arrival, prompt tokens)

    @property
    def running(self) -> int:
        return self._slots.borrowed_tokens

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # admission needs no loop of its own

    @asynccontextmanager
    async def _admitted(self, arrival: float):
        self.waiting += 1
        self._observer.queued(self.name)
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self._observer.started(self.name, time.monotonic() - arrival)
        try:
            yield
        finally:
            self._slots.release()

    async def prefill(self, ctx: str, tokens: Sequence[int], parent: str | None = None) -> None:
        """A prefill primitive: fills a context (a fork when ``parent`` is given)."""
        arrival = time.monotonic()
        async with self._admitted(arrival):
            await self.engine.prefill(ctx, tokens, parent)
        self._arrivals[ctx] = (arrival, len(tokens))

    async def decode(self, ctx: str, params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """A decode primitive on a prefilled context; the context is freed when the iterator closes."""
        arrival, prompt_tokens = self._arrivals.pop(ctx, (time.monotonic(), 0))
        try:
            async with self._admitted(time.monotonic()):
                async for delta in self._timed(self.engine.decode(ctx, params), arrival, prompt_tokens):
                    yield delta
        finally:
            with anyio.CancelScope(shield=True):
                await self.engine.free(ctx)

    async def free(self, ctx: str) -> None:
        self._arrivals.pop(ctx, None)
        await self.engine.free(ctx)

    async def generate(self, tokens: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Prefill, decode and free in one request. Close the iterator to abort it."""
        arrival = time.monotonic()
        async with self._admitted(arrival):
            async for delta in self._timed(self.engine.generate(tokens, params), arrival, len(tokens)):
                yield delta

    async def _timed(self, deltas: AsyncIterator[TokenDelta], arrival: float, prompt_tokens: int):
        generated, last = 0, None
        try:
            async for delta in deltas:
                now = time.monotonic()
                if last is None:
                    self._observer.first_token(self.name, now - arrival)
                else:
                    self._observer.next_token(self.name, (now - last) / max(1, len(delta.token_ids)))
                last = now
                generated += len(delta.token_ids)
                yield delta
        finally:
            await deltas.aclose()
            self._observer.finished(self.name, time.monotonic() - arrival, prompt_tokens, generated)
