"""The per-engine scheduler for LLMs: a policy-ordered admission queue in front of continuous batching.

The engine batches every admitted request per iteration; this scheduler

- ranks each request by its LLM policy (``llm_policies``: ``fifo``, ``topology``,
  ``objective``) from the primitive's ``PrimitiveMeta`` (None for a request from
  outside any run), and hands the rank to the engine as its ``priority``, which
  every iteration of the engine honours;
- bounds how many runs it serves at once (``max_runs``, ``run_gate``) and how
  many requests are admitted (``max_running``), letting waiting ones in most
  urgent first, in the same order;
- times each request for the metrics: queue time, time to first token (from the
  prefill's arrival), inter-token latency and end-to-end latency;
- under a policy that preempts (``las``), sends prefills and decodes ``preemptive``
  to an engine that can pause decodes (``PausesDecodes``), so a request of a higher
  rank may pause running decodes of a lower rank (decided per request: a policy
  switched on a live daemon applies to the requests that come after);
- sends a named program's decodes ``keep_context`` to an engine that can keep a whole
  context in its prefix cache (``KeepsContexts``): only such a request's next turn repeats
  its output, so only it pays the copy;
- sends each prefill, generate and scoring call its ``PrimitiveMeta.cache_partition`` (the API key's
  and ``cache_salt``'s digest) to an engine that ``IsolatesCaches``, so it reuses only KV its own
  partition cached (issue 50); an engine that cannot partition is sent none and warned of once.

A context keeps the meta of the primitive using it (its prefill, then its decode).

Each run's service on this engine is counted, so a policy ranking by attained service (``las``) sees a
workflow run's or a session's earlier calls as well as a named program's earlier requests
(``PrimitiveMeta.attained_tokens``).
Service is what the engine computed: a finished request's prompt tokens less those its prefix cache
held, plus its generated tokens. A client-side agent resends its whole context every turn; counted as
sent, each turn would add its history again, though the engine serves it almost free from the cache
(Autellix counts a call's engine time; tokens computed are its deterministic stand-in, and a batched
iteration's time is shared among its requests anyway). The count of cached tokens comes from the
engine (its prefill's answer, or a generate's first delta, ``TokenDelta.cached_tokens``); the first
delta a decode yields carries it on, for the OpenAI usage and a route's own program count.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Mapping, Sequence

import anyio
import torch

from headrace.batching.llm_policies import FifoLLMPolicy, LLMPolicy, priority
from headrace.batching.meta import PrimitiveMeta
from headrace.batching.observer import NullObserver, SchedulerObserver
from headrace.batching.programs import ProgramRegistry
from headrace.batching.residency import AlwaysResident, Residency
from headrace.batching.run_gate import RunGate
from headrace.plugins.protocols import (IsolatesCaches, KeepsContexts, LLMEngine, PausesDecodes, PlacesDocuments,
                                        PromptLogprobs, SamplingParams, ScoresThroughCache, TokenDelta)

log = logging.getLogger(__name__)


@dataclass
class ContextState:
    """A live KV context, as the scheduler tracks it."""

    arrival: float  # its prefill's arrival: time to first token counts from here
    prompt_tokens: int
    meta: PrimitiveMeta | None  # the primitive using it now: its prefill, then its decode
    holds: str | None = None  # the run this context keeps in the run gate (released when it is freed)
    cached: int = 0  # of ``prompt_tokens``, those the engine's prefix cache held (not computed)


@dataclass(order=True)
class _Waiter:
    priority: int
    order: int
    admitted: anyio.Event = field(compare=False, default_factory=anyio.Event)


class PriorityGate:
    """At most ``capacity`` holders; waiters are admitted lowest priority first, in arrival order among equals."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.borrowed = 0
        self._heap: list[_Waiter] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._heap)

    async def acquire(self, priority: int) -> None:
        if self.borrowed < self.capacity and not self._heap:
            self.borrowed += 1
            return
        waiter = _Waiter(priority, next(self._order))
        heapq.heappush(self._heap, waiter)
        try:
            await waiter.admitted.wait()
        except BaseException:
            if waiter.admitted.is_set():
                self.release()  # admitted as it was cancelled: hand the slot on
            else:
                self._heap.remove(waiter)
                heapq.heapify(self._heap)
            raise

    def release(self) -> None:
        self.borrowed -= 1
        while self.borrowed < self.capacity and self._heap:
            self.borrowed += 1
            heapq.heappop(self._heap).admitted.set()


class LLMScheduler:
    def __init__(self, engine: LLMEngine, *, max_running: int, observer: SchedulerObserver | None = None,
                 policy: LLMPolicy | None = None, policies: Mapping[str, LLMPolicy] | None = None,
                 residency: Residency | None = None, max_runs: int = 0) -> None:
        self.engine = engine
        # Keeps the engine loaded while an admitted request runs (the daemon's memory budget may unload it
        # when nothing runs and no context is live: see ``contexts``).
        self.residency = residency or AlwaysResident()
        self.name = engine.name
        self.policy: LLMPolicy = policy or FifoLLMPolicy()
        # Policies a run may name for its own requests (``PrimitiveMeta.policy``).
        self.policies = dict(policies or {})
        self._slots = PriorityGate(max_running)
        self.run_gate = RunGate(max_runs)  # 0: every run at once
        self._observer = observer or NullObserver()
        self.contexts: dict[str, ContextState] = {}
        # Requests waiting or admitted, by run (None: outside any run): who else the engine serves now.
        self._requests_by_run: Counter[str | None] = Counter()
        # Tokens each run was served here so far (bounded; a run idle for ten minutes is forgotten).
        self.served = ProgramRegistry()
        self._warned_shared = False  # a partition came for an engine that cannot keep its caches apart

    @property
    def running(self) -> int:
        return self._slots.borrowed

    @property
    def waiting(self) -> int:
        return self._slots.waiting

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # admission needs no loop of its own

    def priority(self, meta: PrimitiveMeta | None, arrival: float, now: float | None = None) -> int:
        """The engine priority of a request arriving at ``arrival``, ranked at ``now`` (default: then), on
        the ``time.monotonic()`` clock."""
        run_policy = self.policies.get(meta.policy) if meta is not None and meta.policy else None
        if meta is not None and getattr(self.policy, "ranks_by_attained", False):
            served = self.served.attained(meta.run)  # this run's earlier requests, on top of its program's
            if served:
                meta = replace(meta, attained_tokens=meta.attained_tokens + served)
        return priority(self.policy, run_policy, meta, int(arrival * 1000), None if now is None else int(now * 1000))

    def _preemption(self) -> dict[str, bool]:
        """The engine call's extra keywords: ``preemptive`` where the policy preempts and the engine can pause
        decodes; none otherwise (an engine without the flag is never sent it)."""
        if getattr(self.policy, "preempts", False) and isinstance(self.engine, PausesDecodes) \
                and self.engine.pauses_decodes:
            return {"preemptive": True}
        return {}

    def _partition(self, meta: PrimitiveMeta | None) -> dict[str, str]:
        """The engine call's ``cache_partition`` keyword: the request's partition, to an engine that isolates its
        caches; none for the shared partition (the call every engine has always taken)."""
        partition = meta.cache_partition if meta is not None else ""
        if not partition:
            return {}
        if isinstance(self.engine, IsolatesCaches) and self.engine.isolates_caches:
            return {"cache_partition": partition}
        if not self._warned_shared:
            self._warned_shared = True
            log.warning("engine %s cannot keep cached KV apart by API key or cache_salt: its requests share "
                        "its caches", self.name)
        return {}

    @property
    def places_documents(self) -> bool:
        return isinstance(self.engine, PlacesDocuments) and self.engine.places_documents

    def _decode_keywords(self, meta: PrimitiveMeta | None) -> dict[str, bool]:
        """A decode's extra keywords: ``_preemption``'s, and ``keep_context`` for a named program's request to an
        engine that keeps contexts (never sent to one that does not)."""
        extra = self._preemption()
        if meta is not None and meta.program is not None and isinstance(self.engine, KeepsContexts) \
                and self.engine.keeps_contexts:
            extra["keep_context"] = True
        return extra

    def busy_with_other_runs(self, run: str) -> bool:
        """Whether requests or live contexts of anything but ``run`` are on the engine now."""
        if any(n and owner != run for owner, n in self._requests_by_run.items()):
            return True
        return any(state.meta is None or state.meta.run != run for state in self.contexts.values())

    @asynccontextmanager
    async def _admitted(self, arrival: float, rank: int, metas: Sequence[PrimitiveMeta | None]) -> AsyncIterator[int]:
        """Hold a place for the request through the run gate, the slots and residency; yields its rank as of now."""
        owners = {meta.run if meta is not None else None for meta in metas} or {None}
        self._requests_by_run.update(owners)
        try:
            self._observer.queued(self.name)
            def rank_now() -> int:  # a policy's rank may change while the request waits (a run turning late)
                now = time.monotonic()
                return min((self.priority(m, arrival, now) for m in metas), default=rank)

            held = await self.run_gate.enter(owners, rank, rerank=rank_now)
            try:
                await self._slots.acquire(rank)
                try:
                    async with self.residency.hold():
                        self._observer.started(self.name, time.monotonic() - arrival)
                        yield rank_now()
                finally:
                    self._slots.release()
            finally:
                self.run_gate.leave(held)
        finally:
            self._requests_by_run.subtract(owners)
            for owner in owners:
                if not self._requests_by_run[owner]:
                    del self._requests_by_run[owner]

    async def prefill(self, ctx: str, tokens: Sequence[int], parent: str | None = None,
                      meta: PrimitiveMeta | None = None, documents: Sequence[tuple[int, int]] = ()) -> None:
        """A prefill primitive: fills a context (a fork when ``parent`` is given); ``documents``: spans of
        ``tokens`` an engine that ``PlacesDocuments`` may place (sent to no other)."""
        arrival = time.monotonic()
        rank = self.priority(meta, arrival)
        placed = {"documents": tuple(documents)} if documents and self.places_documents else {}
        async with self._admitted(arrival, rank, (meta,)) as rank:
            cached = await self.engine.prefill(ctx, tokens, parent, priority=rank, **self._preemption(),
                                               **self._partition(meta), **placed)
            # Recorded before the engine is let go: a live context keeps it loaded until freed,
            # and keeps its run in the run gate (its decode must not wait behind other runs).
            run = meta.run if meta is not None else None
            self._forget(ctx)  # a context filled again (a fork's target reused) holds once
            self.contexts[ctx] = ContextState(arrival, len(tokens), meta, holds=run,
                                              cached=cached if isinstance(cached, int) else 0)
            self.run_gate.hold(run)

    async def prepare_documents(self, documents: Sequence[Sequence[int]], meta: PrimitiveMeta | None = None) -> int:
        """Documents' KV computed for placement, in ``meta``'s cache partition, on an engine that ``PlacesDocuments``;
        how many it holds (0 on any other engine)."""
        if not self.places_documents:
            return 0
        return await self.engine.prepare_documents(documents, **self._partition(meta))

    async def decode(self, ctx: str, params: SamplingParams,
                     meta: PrimitiveMeta | None = None) -> AsyncIterator[TokenDelta]:
        """A decode primitive on a prefilled context; the context is freed when the iterator closes."""
        state = self.contexts.setdefault(ctx, ContextState(time.monotonic(), 0, None))
        state.meta = meta or state.meta
        arrival = time.monotonic()
        rank = self.priority(state.meta, arrival)
        try:
            async with self._admitted(arrival, rank, (state.meta,)) as rank:
                deltas = self.engine.decode(ctx, params, priority=rank, **self._decode_keywords(state.meta))
                async for delta in self._timed(deltas, state.arrival, state.prompt_tokens, state.meta, state.cached):
                    yield delta
        finally:
            self._forget(ctx)
            with anyio.CancelScope(shield=True):
                await self.engine.free(ctx)

    async def free(self, ctx: str) -> None:
        self._forget(ctx)
        await self.engine.free(ctx)

    def _forget(self, ctx: str) -> None:
        state = self.contexts.pop(ctx, None)
        if state is not None and state.holds is not None:
            self.run_gate.leave((state.holds,))

    async def generate(self, tokens: Sequence[int], params: SamplingParams,
                       meta: PrimitiveMeta | None = None) -> AsyncIterator[TokenDelta]:
        """Prefill, decode and free in one request. Close the iterator to abort it."""
        arrival = time.monotonic()
        rank = self.priority(meta, arrival)
        async with self._admitted(arrival, rank, (meta,)) as rank:
            deltas = self.engine.generate(tokens, params, priority=rank, **self._decode_keywords(meta),
                                          **self._partition(meta))
            async for delta in self._timed(deltas, arrival, len(tokens), meta):
                yield delta

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int],
                                metas: Sequence[PrimitiveMeta | None] = (), *,
                                through_cache: bool = False) -> torch.Tensor:
        """Prefill-only scoring (the LLM reranker's call), admitted and ranked like every other request, its prompt
        tokens counted as one request's.

        One call may serve several primitives (a rerank batch of several runs): it ranks as the
        most urgent of ``metas``. ``through_cache``: each prompt prefilled through the engine's prefix cache and
        tiers where it ``ScoresThroughCache`` (``metas`` then all of one cache partition), so a prefix cached
        before (a document scored for another query) is restored rather than computed."""
        arrival = time.monotonic()
        rank = min((self.priority(m, arrival) for m in metas), default=self.priority(None, arrival))
        cached, outcome = 0, "abort"  # unless it finishes or fails: cancelled
        try:
            async with self._admitted(arrival, rank, metas) as rank:
                if through_cache and isinstance(self.engine, ScoresThroughCache) and self.engine.scores_through_cache:
                    partitions = {m.cache_partition for m in metas if m is not None}
                    if len(partitions) > 1:
                        raise ValueError("scoring through the cache needs its prompts in one cache partition")
                    meta = next((m for m in metas if m is not None), None)
                    logits, cached = await self.engine.next_token_logits_cached(prompts, token_ids, priority=rank,
                                                                                **self._partition(meta))
                else:
                    logits = await self.engine.next_token_logits(prompts, token_ids, priority=rank)
            outcome = "stop"
            return logits
        except Exception:
            outcome = "error"
            raise
        finally:
            self._observer.finished(self.name, time.monotonic() - arrival, sum(len(p) for p in prompts), 0, outcome,
                                    cached_tokens=cached)

    async def prompt_logprobs(self, tokens: Sequence[int], *, top: int = 0, full: bool = False,
                              meta: PrimitiveMeta | None = None) -> PromptLogprobs:
        """Teacher-forced scoring (``ScoresPrompts``: echo, ``prompt_logprobs``), admitted and ranked like every
        other request; the engine computes every token, so they all count to the run's service."""
        arrival = time.monotonic()
        rank = self.priority(meta, arrival)
        async with self._admitted(arrival, rank, (meta,)) as rank:
            scorer: Any = self.engine  # a ScoresPrompts engine: the route checks before it calls
            scores = await scorer.prompt_logprobs(tokens, top=top, full=full, priority=rank, **self._partition(meta))
        if meta is not None:
            self.served.add(meta.run, len(tokens))
        return scores

    async def _timed(self, deltas: AsyncIterator[TokenDelta], arrival: float, prompt_tokens: int,
                     meta: PrimitiveMeta | None = None, cached: int = 0):
        """``deltas``, timed for the metrics and counted to the run; ``cached``: the prompt tokens the prefill
        found cached (a generate's engine says so on its first delta instead), put on the first delta."""
        generated, last = 0, None
        outcome = "abort"  # unless it finishes or fails: the client left, or the run was cancelled
        try:
            async for delta in deltas:
                outcome = delta.finish_reason or outcome
                now = time.monotonic()
                if last is None:
                    self._observer.first_token(self.name, now - arrival)
                    if delta.cached_tokens:
                        cached = delta.cached_tokens
                    elif cached:
                        delta = replace(delta, cached_tokens=cached)
                else:
                    self._observer.next_token(self.name, (now - last) / max(1, len(delta.token_ids)))
                last = now
                generated += len(delta.token_ids)
                yield delta
        except Exception:
            outcome = "error"
            raise
        finally:
            await deltas.aclose()
            if meta is not None:
                self.served.add(meta.run, max(0, prompt_tokens - cached) + generated)
            self._observer.finished(self.name, time.monotonic() - arrival, prompt_tokens, generated, outcome,
                                    cached_tokens=cached)
