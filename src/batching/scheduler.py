"""The per-engine scheduler for batchable engines (embed, rerank, vector store).

Requests queue here; a single loop forms batches by policy, waiting at most
``max_wait_ms`` for a batch to fill, and runs one batch at a time on the engine.

Faults stay with the request that caused them: nothing a request does (leaving
while it waits, carrying a payload the engine rejects, naming an odd policy)
ends the loop. A batch whose runner raises is split in halves and retried, so
only the items that fail on their own get an error, each its own.

A run may name its own batch policy (``PrimitiveMeta.policy``). The engine's
policy forms each batch over the whole queue, so it decides how many slots each
run gets; a run with its own policy then fills its slots with the requests its
policy picks among that run's requests. So an override reorders its own run's
requests and no one else's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

import anyio

from headrace.batching.meta import PrimitiveMeta
from headrace.batching.observer import NullObserver, SchedulerObserver
from headrace.batching.policies import BatchPolicy, run_of
from headrace.batching.queue import Pending
from headrace.batching.residency import AlwaysResident, EngineUnavailable, Residency

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
        residency: Residency | None = None,
    ) -> None:
        # Keeps the engine loaded while a batch runs; under a memory budget it may be unloaded between
        # batches, and the queue waits here for its reload.
        self.residency = residency or AlwaysResident()
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
        # When the batch running now started (None: none runs): a batch that never ends is a
        # wedged engine, which the daemon's watchdog looks for.
        self.busy_since: float | None = None

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def submit(self, payload: Any, size: int, meta: PrimitiveMeta | None = None) -> Any:
        """The result of ``payload`` (an ``EngineRequest`` for the built-in runners) once its batch ran."""
        item = Pending(payload, size, meta)
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
            try:
                # The batch is picked once the engine is loaded: what arrives during a load joins it.
                async with self.residency.hold():
                    await self._run_next()
            except EngineUnavailable as exc:  # what waits for it gets the error; later requests try again
                log.error("scheduler %s: %s", self.name, exc)
                failed, self._queue = self._queue, []
                for item in failed:
                    item.resolve(error=exc)

    async def _run_next(self) -> None:
        if not self._queue:  # everyone waiting left during the load
            return
        batch = self._select()
        for item in batch:
            self._queue.remove(item)
        self.busy_since = time.monotonic()
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
        finally:
            self.busy_since = None

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
        queue = list(self._queue)
        try:
            batch = _pick(self.policy, queue, self.max_batch_size)
        except Exception:
            log.exception("scheduler %s: batch policy failed; running the oldest request alone", self.name)
            batch = []
        if not batch:
            return [queue[0]]
        for run, policy in self._overrides(queue).items():
            try:
                batch = _reorder_run(batch, queue, run, policy)
            except Exception:  # that run's policy failed: its slots keep the engine policy's pick
                log.exception("scheduler %s: batch policy %r of run %s failed", self.name, policy.name, run)
        return batch

    def _overrides(self, queue: Sequence[Pending]) -> dict[str, BatchPolicy]:
        """The runs in the queue that name a known policy other than the engine's."""
        out: dict[str, BatchPolicy] = {}
        for item in queue:
            if item.meta is None or not isinstance(item.meta.policy, str):
                continue
            policy = self.policies.get(item.meta.policy)
            if policy is not None and policy.name != self.policy.name:
                out.setdefault(item.meta.run, policy)
        return out

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
                self._observer.finished(self.name, time.monotonic() - batch[0].arrival, 0, 0, "error")
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
            self._observer.finished(self.name, time.monotonic() - item.arrival, 0, 0, "stop")


def _pick(policy: BatchPolicy, queue: Sequence[Pending], capacity: int) -> list[Pending]:
    """What ``policy`` selects, each queued request at most once."""
    queued = set(queue)
    return [item for item in dict.fromkeys(policy.select(list(queue), capacity)) if item in queued]


def _reorder_run(batch: list[Pending], queue: Sequence[Pending], run: str, policy: BatchPolicy) -> list[Pending]:
    """Fill the slots ``batch`` gives ``run`` with what ``policy`` picks among the run's own requests.

    The run keeps the capacity the engine's policy gave it; a pick that does not fit
    it (an oversized request the policy would run alone) leaves the batch as it was.
    """
    slots = [i for i, item in enumerate(batch) if run_of(item) == run]
    if not slots:
        return batch
    capacity = sum(batch[i].size for i in slots)
    chosen = _pick(policy, [item for item in queue if run_of(item) == run], capacity)
    if not chosen or sum(item.size for item in chosen) > capacity:
        return batch
    at = slots[0]  # the run's requests go where its first slot was
    return batch[:at] + chosen + [item for item in batch[at:] if run_of(item) != run]
