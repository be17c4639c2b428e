"""Preemption in an LLM core: which decoding rows leave the batch for more urgent work, and when they return.

Autellix (program-level least attained service) pauses a low-rank program's decode when a call of a
higher rank cannot get in. Here a paused row (a ``core.Row``) keeps its KV and everything else: it
only leaves the batch, with its pending token, its length and its sampler's state, and later rejoins as
the same object, so its output is what it would have been unpaused (greedy: the same tokens). Nothing is
recomputed or swapped out, so a pause frees batch room (row slots, tokens of an iteration), never KV
cells or sequences: a prefill waiting for a free sequence is not helped by it.

Only requests sent ``preemptive`` take part: the LLM scheduler sets it under a policy that preempts
(``las``); others neither pause nor are paused, so under ``fifo`` a core behaves as without this module.

Each iteration, before decodes join the batch, the core asks :meth:`PausedRows.update` which rows run.
It hands out the iteration's room (``row_limit`` decode rows, ``token_budget`` tokens) in this order:

1. every running row that is not preemptive (it is never paused);
2. overdue preemptive rows, most urgent first (below);
3. preemptive rows, running or paused, and preemptive work that wants in (:class:`Want`), most urgent
   (lowest ``priority``) first, a row before a want of the same rank (nothing pauses for an equal):
   a decoding row takes a slot and a token, a decode waiting to join takes a slot and a token (it then
   joins through the core's own admission), a prefill the tokens it has left (as many as remain).

A row that finds no slot or no token left pauses; a paused row that finds both resumes. So a row pauses
only while more urgent work would otherwise be held back by it, and the least urgent rows pause first.

Starvation is bounded twice. Ranks age: under ``las`` a request is outranked only by requests that
arrive within its handicap after it (``LasLLMPolicy``), so the work that can pause a row is finite. And
a row paused ``max_pause`` seconds in all is overdue: it goes ahead of all preemptive work (step 2) and
is never paused again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from headrace.plugins.engines.llm.core import Row
from headrace.types import ContextId

MAX_PAUSE_SECONDS = 10.0


@dataclass(frozen=True)
class Want:
    """Preemptive work that wants into this iteration's batch: a decode waiting to join (one row slot and one
    token) or a prefill (no slot; the tokens it has left)."""

    priority: int
    slots: int
    tokens: int


def choose(running: Sequence[Row], paused: Sequence[Row], wants: Sequence[Want], *, row_limit: int,
           token_budget: int, now: float, max_pause: float) -> set[int]:
    """The ids (``id(row)``) of the rows of ``running`` and ``paused`` that run this iteration (the module's
    order); the others pause or stay paused."""
    slots, tokens = row_limit, token_budget
    keep: set[int] = set()
    for r in running:
        if not r.preemptive:
            keep.add(id(r))
            slots, tokens = slots - 1, tokens - 1
    contenders: list[tuple[tuple[int, int, int, int], Row | Want]] = []
    for order, r in enumerate([*running, *paused]):
        if r.preemptive:
            contenders.append(((0 if overdue(r, now, max_pause) else 1, r.priority, 0, order), r))
    for order, w in enumerate(wants):
        contenders.append(((1, w.priority, 1, order), w))
    contenders.sort(key=lambda c: c[0])
    for _, item in contenders:
        if isinstance(item, Want):
            if item.slots == 0:
                tokens -= min(max(tokens, 0), item.tokens)
            elif slots >= item.slots and tokens >= item.tokens:
                slots, tokens = slots - item.slots, tokens - item.tokens
        elif slots >= 1 and tokens >= 1:
            keep.add(id(item))
            slots, tokens = slots - 1, tokens - 1
    return keep


def overdue(r: Row, now: float, max_pause: float) -> bool:
    """Paused ``max_pause`` seconds in all (now included): it may not wait again."""
    pausing = now - r.paused_at if r.paused_at is not None else 0.0
    return r.paused_for + pausing >= max_pause


class PausedRows:
    """A core's paused rows, and the count of pauses since it started."""

    def __init__(self, max_pause: float = MAX_PAUSE_SECONDS) -> None:
        self.max_pause = max_pause
        self.rows: list[Row] = []
        self.pauses = 0

    def __len__(self) -> int:
        return len(self.rows)

    def update(self, running: list[Row], wants: Sequence[Want], *, row_limit: int, token_budget: int) -> list[Row]:
        """The rows to run this iteration: ``running`` less those that pause now, plus those that resume."""
        if not self.rows and not wants:
            return running  # nothing wants in and nothing waits to come back: no change
        now = time.monotonic()
        keep = choose(running, self.rows, wants, row_limit=row_limit, token_budget=token_budget, now=now,
                      max_pause=self.max_pause)
        resumed = [r for r in self.rows if id(r) in keep]
        for r in resumed:
            r.paused_for += now - (r.paused_at or now)
            r.paused_at = None
        pausing = [r for r in running if id(r) not in keep]
        for r in pausing:
            r.paused_at = now
        self.pauses += len(pausing)
        self.rows = [r for r in self.rows if id(r) not in keep] + pausing
        return [r for r in running if id(r) in keep] + resumed

    def drop(self, ctx: ContextId) -> None:
        """The context's decode was stopped: it no longer waits to resume."""
        self.rows = [r for r in self.rows if r.ctx != ctx]

    def take_all(self) -> list[Row]:
        rows, self.rows = self.rows, []
        return rows
