"""The per-engine scheduler for batchable engines (embed, rerank, vector store).

Requests queue here; a single loop forms batches by policy, waiting at most
``max_wait_ms`` for a batch to fill, and runs one batch at a time on the engine.

Faults stay with the request that caused them: nothing a request does (leaving
while it waits, carrying a payload the engine rejects, naming an odd policy)
ends the loop. A batch whose runner raises is split in halves and retried, so
only the items that fail on their own get an error, each its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

import anyio

from headrace.batching.observer import NullObserver, SchedulerObserver
from headrace.batching.policies import BatchPolicy
from headrace.batching.queue import Pending

log = logging.getLogger(__name__)

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
            if not item.done.is_set():
                # Cancelled: it never runs if still queued, and a retry skips it.
                item.abandoned = True
                if item in self._queue:
                    self._queue.remove(item)
        if item.error is not None:
            raise item.error
        return item.result

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. The queue lives on the scheduler, so a restarted loop picks it up."""
        task_status.started()
        while True:
            await self._fill()
            if not self._queue:  # everyone waiting left inside the max_wait window
                continue
            batch = self._select()
            for item in batch:
                self._queue.remove(item)
            try:
                await self._run_batch(batch, first_try=True)
            except BaseException:
                # The loop is stopping (cancelled, or a bug its supervisor restarts it from):
                # these requests left the queue, so nobody else would ever answer them.
                for item in batch:
                    if not item.done.is_set():
                        item.resolve(error=RuntimeError(f"engine {self.name!r}: its scheduler stopped "
                                                        "while running the request"))
                raise

    async def _fill(self) -> None:
        """Wait for a request, then up to max_wait past the oldest's arrival for a full batch.

        Returns with an empty queue when every waiting request was cancelled meanwhile.
        """
        while not self._queue:
            await self._wait_for_arrival(None)
        while self._queue and sum(p.size for p in self._queue) < self.max_batch_size:
            remaining = self._queue[0].arrival + self.max_wait - time.monotonic()
            if remaining <= 0:
                return
            await self._wait_for_arrival(remaining)

    async def _wait_for_arrival(self, timeout: float | None) -> None:
        self._arrived = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._arrived.wait()

    def _select(self) -> list[Pending]:
        """The policy's pick; the oldest request alone if the policy misbehaves."""
        head = self._queue[0]
        try:
            name = head.meta.get("policy")
            policy = self.policies.get(name, self.policy) if isinstance(name, str) else self.policy
            picked = policy.select(list(self._queue), self.max_batch_size)
            queued = set(self._queue)
            batch = [item for item in dict.fromkeys(picked) if item in queued]
        except Exception:
            log.exception("scheduler %s: batch policy failed; running the oldest request alone", self.name)
            batch = []
        return batch or [head]

    async def _run_batch(self, batch: list[Pending], *, first_try: bool) -> None:
        if first_try:
            now = time.monotonic()
            for item in batch:
                self._observer.started(self.name, now - item.arrival)
        try:
            results = await self._runner([item.payload for item in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine {self.name!r} returned {len(results)} results for {len(batch)} requests")
        except Exception as exc:
            if len(batch) == 1:
                batch[0].resolve(error=exc)
                return
            # Bisect: the halves that succeed answer; a bad item ends up alone with its own error.
            log.info("scheduler %s: batch of %d failed (%s); retrying in halves", self.name, len(batch), exc)
            middle = len(batch) // 2
            for half in (batch[:middle], batch[middle:]):
                live = [item for item in half if not item.abandoned]
                if live:
                    await self._run_batch(live, first_try=False)
            return
        for item, result in zip(batch, results):
            item.resolve(result)
            self._observer.finished(self.name, time.monotonic() - item.arrival, 0, 0)
