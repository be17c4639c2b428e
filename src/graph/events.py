"""A run's events: one bounded log per run, which any number of readers follow at their own pace.

Backpressure is explicit and never reaches the run: publishing does not wait, so a slow
reader can neither pause nor cancel a run. A reader that falls more than ``capacity`` events
behind misses the oldest ones; it is told how many with an ``events.dropped`` event and goes on
from the oldest event still held. The newest events are always held, so every reader learns
how the run ended. Each event has a sequence number (its SSE ``id``), so a client that
reconnects resumes where it left off.

Once the run has ended and no reader follows it, the log shrinks to its last event: a
finished run kept for ``GET /v1/runs/{id}`` does not hold its token deltas.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import anyio

EVENT_LOG = 1024  # events held per run; a run emits a few per node and one per streamed token or piece
FINAL_EVENTS = frozenset({"run.finished", "run.failed"})


@dataclass(frozen=True)
class RunEvent:
    """One event as a reader gets it: its sequence number in the run (from 0) and its body."""

    seq: int
    body: dict[str, Any]

    @property
    def name(self) -> str:
        return self.body["event"]


class RunEvents:
    def __init__(self, capacity: int = EVENT_LOG) -> None:
        if capacity < 1:
            raise ValueError("a run's event log holds at least one event")
        self.capacity = capacity
        self._log: deque[dict[str, Any]] = deque()
        self._first = 0  # the sequence number of ``_log[0]``
        self._closed = False
        self._readers = 0
        self._changed = anyio.Event()
        self.dropped = 0  # events some reader missed because it fell behind

    @property
    def next_seq(self) -> int:
        return self._first + len(self._log)

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, event: dict[str, Any]) -> None:
        """Append ``event`` (stamped with the wall time); a final event closes the log."""
        if self._closed:
            return  # the run has ended; a straggler (a cancelled node's last word) changes nothing
        self._log.append({**event, "time": time.time()})
        if len(self._log) > self.capacity:
            self._log.popleft()
            self._first += 1
        if event["event"] in FINAL_EVENTS:
            self._closed = True
            self._release_if_unread()
        self._wake()

    def close(self) -> None:
        """No more events (a run that ended without a final event, e.g. one never started)."""
        if not self._closed:
            self._closed = True
            self._release_if_unread()
            self._wake()

    def follow(self, after: int | None = None) -> EventReader:
        """A reader of the events after sequence number ``after`` (None: from the first one held), live until
        the log closes. It holds the log from now (not from its first read) until it is closed."""
        return EventReader(self, self._first if after is None else max(after + 1, 0))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _attach(self) -> None:
        self._readers += 1

    def _detach(self) -> None:
        self._readers -= 1
        self._release_if_unread()

    def _release_if_unread(self) -> None:
        if self._closed and self._readers == 0 and len(self._log) > 1:
            self._first += len(self._log) - 1
            last = self._log[-1]
            self._log.clear()
            self._log.append(last)


class EventReader:
    """One reader's cursor over a run's events: ``async with`` it, then ``async for`` its events."""

    def __init__(self, events: RunEvents, cursor: int) -> None:
        self._events, self._cursor, self._open = events, cursor, True
        events._attach()

    async def __aenter__(self) -> EventReader:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            self._events._detach()

    def __aiter__(self) -> EventReader:
        return self

    async def __anext__(self) -> RunEvent:
        log = self._events
        while self._open:
            if self._cursor < log._first:
                missed, self._cursor = log._first - self._cursor, log._first
                log.dropped += missed
                return RunEvent(-1, {"event": "events.dropped", "missed": missed, "resume": self._cursor,
                                     "time": time.time()})
            if self._cursor < log.next_seq:
                event = RunEvent(self._cursor, log._log[self._cursor - log._first])
                self._cursor += 1
                return event
            if log.closed:
                break
            await log._changed.wait()
        self.close()
        raise StopAsyncIteration
