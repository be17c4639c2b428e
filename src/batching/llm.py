"""The per-engine scheduler for LLMs: admission queue in front of continuous batching.

The engine batches every admitted request per iteration; this queue bounds how
many are admitted (``max_running``) and times each request for the metrics:
queue time, time to first token (from the prefill's arrival), inter-token
latency and end-to-end latency.

Each primitive comes with its ``PrimitiveMeta`` (None for a request from outside
any run), kept per context while the context lives, for the LLM policies to read.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import anyio

from headrace.batching.meta import PrimitiveMeta
from headrace.batching.observer import NullObserver, SchedulerObserver
from headrace.plugins.protocols import LLMEngine, SamplingParams, TokenDelta


@dataclass
class ContextState:
    """A live KV context, as the scheduler tracks it."""

    arrival: float  # its prefill's arrival: time to first token counts from here
    prompt_tokens: int
    meta: PrimitiveMeta | None  # the primitive using it now: its prefill, then its decode


class LLMScheduler:
    def __init__(self, engine: LLMEngine, *, max_running: int, observer: SchedulerObserver | None = None) -> None:
        self.engine = engine
        self.name = engine.name
        self._slots = anyio.CapacityLimiter(max_running)
        self._observer = observer or NullObserver()
        self.waiting = 0
        self.contexts: dict[str, ContextState] = {}

    @property
    def running(self) -> int:
        return self._slots.borrowed_tokens

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # admission needs no loop of its own

    @asynccontextmanager
    async def _admitted(self, arrival: float, meta: PrimitiveMeta | None):
        # ``meta`` is what an LLM policy will order admission by; today admission is first come.
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

    async def prefill(self, ctx: str, tokens: Sequence[int], parent: str | None = None,
                      meta: PrimitiveMeta | None = None) -> None:
        """A prefill primitive: fills a context (a fork when ``parent`` is given)."""
        arrival = time.monotonic()
        async with self._admitted(arrival, meta):
            await self.engine.prefill(ctx, tokens, parent)
        self.contexts[ctx] = ContextState(arrival, len(tokens), meta)

    async def decode(self, ctx: str, params: SamplingParams,
                     meta: PrimitiveMeta | None = None) -> AsyncIterator[TokenDelta]:
        """A decode primitive on a prefilled context; the context is freed when the iterator closes."""
        state = self.contexts.setdefault(ctx, ContextState(time.monotonic(), 0, None))
        state.meta = meta or state.meta
        try:
            async with self._admitted(time.monotonic(), state.meta):
                async for delta in self._timed(self.engine.decode(ctx, params), state.arrival, state.prompt_tokens):
                    yield delta
        finally:
            self.contexts.pop(ctx, None)
            with anyio.CancelScope(shield=True):
                await self.engine.free(ctx)

    async def free(self, ctx: str) -> None:
        self.contexts.pop(ctx, None)
        await self.engine.free(ctx)

    async def generate(self, tokens: Sequence[int], params: SamplingParams,
                       meta: PrimitiveMeta | None = None) -> AsyncIterator[TokenDelta]:
        """Prefill, decode and free in one request. Close the iterator to abort it."""
        arrival = time.monotonic()
        async with self._admitted(arrival, meta):
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
