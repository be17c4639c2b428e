"""Run admission for an LLM engine: at most ``limit`` runs served at once, the waiting ones let in by rank.

An engine batches every admitted request each step, so without a bound every run in flight
shares every decode step and in overload all of them finish late together. With a bound the
engine serves a few runs at full speed while the others wait, and the LLM policy decides which
runs those are (``deadline``: the ones that can still make their SLO).

A run is in while it has a request admitted or a live context on the engine; its further
requests then pass at once, so a run that is in never waits on runs that are not (no deadlock
between a run's own prefill and decode). A request of several runs (a rerank batch) passes when
any of them is in, and otherwise lets them all in together, which may pass the bound by a few
runs rather than split the batch. Requests of no run (``None``) are never held.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Collection

import anyio

RunId = str


@dataclass(order=True)
class _Waiting:
    rank: int
    order: int
    runs: frozenset[RunId] = field(compare=False)
    let_in: anyio.Event = field(compare=False, default_factory=anyio.Event)
    rerank: Callable[[], int] | None = field(compare=False, default=None)


class RunGate:
    def __init__(self, limit: int = 0) -> None:
        self._limit = limit  # 0: no bound
        self._holds: Counter[RunId] = Counter()  # admitted requests and live contexts, by run
        self._waiting: list[_Waiting] = []  # kept sorted: most urgent first
        self._order = itertools.count()

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = value
        self._let_in()

    @property
    def inside(self) -> int:
        """Runs served now."""
        return len(self._holds)

    @property
    def waiting(self) -> int:
        """Requests waiting for their run to be let in."""
        return len(self._waiting)

    def is_in(self, run: RunId) -> bool:
        return run in self._holds

    async def enter(self, runs: Collection[RunId | None], rank: int,
                    rerank: Callable[[], int] | None = None) -> frozenset[RunId]:
        """Wait until ``runs`` are in (a request of theirs at ``rank``), and hold them; returns what to ``leave``.

        ``rerank``: the request's rank now, for a policy whose ranks change as time passes (a run
        turning late): asked again each time places free up."""
        runs_ = frozenset(r for r in runs if r is not None)
        if not runs_ or self._passes(runs_):
            self._hold(runs_)
            return runs_
        waiter = _Waiting(rank, next(self._order), runs_, rerank=rerank)
        self._waiting.append(waiter)
        self._waiting.sort()
        try:
            await waiter.let_in.wait()
        except BaseException:
            if waiter.let_in.is_set():
                self.leave(runs_)  # let in as it was cancelled: give the place on
            else:
                self._waiting.remove(waiter)
            raise
        return runs_

    def hold(self, run: RunId | None) -> None:
        """One more thing keeps ``run`` in (a live context), without waiting: it is in already."""
        if run is not None:
            self._hold(frozenset((run,)))

    def leave(self, runs: Collection[RunId | None]) -> None:
        """Drop one hold of each of ``runs``; a run with none left is out, and waiters may come in."""
        for run in runs:
            if run is None:
                continue
            self._holds[run] -= 1
            if self._holds[run] <= 0:
                del self._holds[run]
        self._let_in()

    def _passes(self, runs: frozenset[RunId]) -> bool:
        if not self._limit or any(run in self._holds for run in runs):
            return True
        return len(self._holds) < self._limit and not self._waiting

    def _hold(self, runs: frozenset[RunId]) -> None:
        self._holds.update(runs)

    def _let_in(self) -> None:
        """Let in, most urgent first, every waiter whose run is in already and others while places are free."""
        if any(waiter.rerank is not None for waiter in self._waiting):
            for waiter in self._waiting:
                if waiter.rerank is not None:
                    waiter.rank = waiter.rerank()
            self._waiting.sort()
        for waiter in list(self._waiting):
            already = any(run in self._holds for run in waiter.runs)
            if already or not self._limit or len(self._holds) < self._limit:
                self._waiting.remove(waiter)
                self._hold(waiter.runs)
                waiter.let_in.set()
