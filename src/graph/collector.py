"""One LLM request's output channel: each choice's token deltas, merged while its reader is busy.

After vLLM v1's per-request output collector: the run puts a choice's new tokens without ever
waiting; whatever the reader has not taken yet is merged into one delta per choice (text
appended, token ids and log-probabilities extended, the latest finish reason kept). So a slow
reader neither stalls the engine nor loses a token, and what is held is bounded by the output
itself, not by a buffer sized for the worst case.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from headrace.plugins.protocols import TokenDelta


@dataclass(frozen=True)
class ChoiceDelta:
    """A token delta of one choice of an LLM request (``index``: prompt * n + sample)."""

    index: int
    delta: TokenDelta


class ChoiceCollector:
    def __init__(self) -> None:
        self._pending: dict[int, TokenDelta] = {}  # by choice, in the order each first got output
        self._closed = False
        self._changed = anyio.Event()

    def put(self, index: int, delta: TokenDelta) -> None:
        if self._closed:
            return  # the reader is gone (or the run ended): nobody will take it
        held = self._pending.get(index)
        self._pending[index] = delta if held is None else held.then(delta)
        self._changed.set()

    def close(self) -> None:
        """No more output: the reader gets what is pending, then the end."""
        self._closed = True
        self._changed.set()

    def __aiter__(self) -> ChoiceCollector:
        return self

    async def __anext__(self) -> list[ChoiceDelta]:
        """Every choice's output since the last call (at least one choice's), or the end."""
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._changed.wait()
            self._changed = anyio.Event()
        taken, self._pending = self._pending, {}
        return [ChoiceDelta(index, delta) for index, delta in taken.items()]
