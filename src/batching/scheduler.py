"""The per-engine scheduler for batchable engines (embed, rerank, vector store).

Requests queue here; a single loop forms batches by policy, waiting at most
``max_wait_ms`` for a batch to fill, and runs one batch at a time on the engine.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

import anyio

from headrace.batching.observer import NullObserver, SchedulerObserver
from headrace.batching.policies import BatchPolicy
from headrace.batching.queue import Pending

# Runs a batch: takes the payloads in order, returns one result per payload.
BatchRunner = Callable[[Sequence[Any]], Awaitable[Sequence[Any]]]


class BatchScheduler:
    def __init__(
        self,
        name: str,
        runner: BatchRunner,
        policy: BatchPolicy,
        *,
        max_batch_size: int,
        max_wait_ms: float,
        observer: SchedulerObserver | None = None,
        policies: Mapping[str, BatchPolicy] | None = None,
    ) -> None:
        # Policies a request may ask for by name (a run's override of the engine's policy).
        self.policies = dict(policies or {})
        self.name = name
        self._runner = runner
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000
        self._observer = observer or NullObserver()
        self._queue: list[Pending] = []
        self._arrived = anyio.Event()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def submit(self, payload: Any, size: int, meta: Mapping[str, Any] | None = None) -> Any:
        item = Pending(payload, size, meta or {})
        self._queue.append(item)
        self._observer.queued(self.name)
        self._arrived.set()
        try:
            await item.done.wait()
        finally:
            if not item.done.is_set() and item in self._queue:
                self._queue.remove(item)  # cancelled while waiting: never runs
        if item.error is not None:
            raise item.error
        return item.result

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            while not self._queue:
                self._arrived = anyio.Event()
                await self._arrived.wait()
            await self._fill()
            policy = self.policies.get(self._queue[0].meta.get("policy"), self.policy)
            batch = policy.select(self._queue, self.max_batch_size) or self._queue[:1]
            for item in batch:
                self._queue.remove(item)
            await self._run_batch(batch)

    async def _fill(self) -> None:
        """Wait up to max_wait for the queue to reach a full batch."""
        deadline = self._queue[0].arrival + self.max_wait
        while sum(p.size for p in self._queue) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrived = anyio.Event()
            with anyio.move_on_after(remaining):
                await self._arrived.wait()

    async def _run_batch(self, batch: list[Pending]) -> None:
        now = time.monotonic()
        for item in batch:
            self._observer.started(self.name, now - item.arrival)
        try:
            results = await self._runner([item.payload for item in batch])
        except Exception as exc:
            for item in batch:
                item.resolve(error=exc)
            return
        for item, result in zip(batch, results, strict=True):
            item.resolve(result)
            self._observer.finished(self.name, time.monotonic() - item.arrival, 0, 0)
