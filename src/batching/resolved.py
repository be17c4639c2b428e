"""The graph's view of the schedulers: what it may call, with the primitive's metadata.

``ResolvedEngine`` is what the engine pool hands the graph for an engine name:
the engine (for what needs no scheduling: tokenizing, context ids) and the
scheduler every call to it goes through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence, runtime_checkable

from headrace.batching.meta import PrimitiveMeta
from headrace.batching.requests import EngineRequest
from headrace.plugins.protocols import Engine, SamplingParams, TokenDelta


@runtime_checkable
class BatchSchedulerProtocol(Protocol):
    """Embed, rerank and vector-store engines: requests queue and run in batches formed by policy."""

    async def submit(self, request: EngineRequest, size: int, meta: PrimitiveMeta | None = None) -> Any:
        """The request's result once its batch ran; ``size`` counts its items against the batch capacity."""
        ...


@runtime_checkable
class LLMSchedulerProtocol(Protocol):
    """LLM engines: the primitives of one call (Parrot's Fill / Generate / FreeContext)."""

    async def prefill(self, ctx: str, tokens: Sequence[int], parent: str | None = None,
                      meta: PrimitiveMeta | None = None) -> None: ...

    def decode(self, ctx: str, params: SamplingParams, meta: PrimitiveMeta | None = None) -> AsyncIterator[TokenDelta]:
        """Token deltas of a prefilled context, which is freed when the iterator closes."""
        ...

    async def free(self, ctx: str) -> None: ...

    def busy_with_other_runs(self, run: str) -> bool:
        """Whether requests or live contexts of anything but ``run`` are on the engine now."""
        ...

    def generate(self, tokens: Sequence[int], params: SamplingParams,
                 meta: PrimitiveMeta | None = None) -> AsyncIterator[TokenDelta]: ...

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int],
                                metas: Sequence[PrimitiveMeta | None] = (), *, through_cache: bool = False) -> Any:
        """Prefill-only scoring, ranked as the most urgent of ``metas``; ``through_cache``: through the engine's
        prefix cache (``ScoresThroughCache``)."""
        ...


@dataclass(frozen=True)
class ResolvedEngine:
    """A ready engine and its scheduler."""

    engine: Engine
    scheduler: BatchSchedulerProtocol | LLMSchedulerProtocol

    def batch(self) -> BatchSchedulerProtocol:
        if not isinstance(self.scheduler, BatchSchedulerProtocol):
            raise TypeError(f"engine {_name(self)!r} is not batch-scheduled (it is an LLM)")
        return self.scheduler

    def llm(self) -> LLMSchedulerProtocol:
        if not isinstance(self.scheduler, LLMSchedulerProtocol):
            raise TypeError(f"engine {_name(self)!r} is not an LLM")
        return self.scheduler


def _name(resolved: ResolvedEngine) -> str:
    return getattr(resolved.engine, "name", "?")
