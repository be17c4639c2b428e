"""A core over an engine that serves every request on a whole token list and keeps its own prefix cache
(headrace-vllm, headrace-sglang): a KV context is its token list, held by :class:`TokenListCore`.

A prefill (``prefill_request``) submits the context's whole token list, which leaves its KV in the
engine's prefix cache; a child's list is its parent's, then its own, so its prefill reuses the
parent's KV. A decode runs the real request on the whole list, a prefix-cache hit. ``generate``
needs no prefill of its own: an engine on such a core sets ``LLMFront.generate_prefill = Hold``, so
its context only records the tokens and its decode is its one request.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path

from headrace.plugins.engines.llm.core import LLMCore
from headrace.plugins.engines.llm.messages import EngineError, Outbox, Prefill
from headrace.plugins.engines.models.loading import convert_gguf
from headrace.plugins.engines.models.paths import resolve_model
from headrace.types import ContextId, TokenIds


@dataclass
class Hold(Prefill):
    """A generate()'s context: the core records its tokens, and the decode that follows computes them
    (one engine request for both, rather than a prefill request first)."""


class TokenListCore(LLMCore):
    """An ``LLMCore`` whose contexts are token lists; the engine's requests are the subclass's."""

    def __init__(self, name: str, max_context_tokens: int) -> None:
        super().__init__(name, max_context_tokens)
        self.contexts: dict[ContextId, TokenIds] = {}

    @abstractmethod
    def prefill_request(self, job: Prefill, tokens: TokenIds) -> None:
        """Submit a prefill of the context's whole token list; answer ``job.reply`` once its KV is cached."""

    def add_prefills(self, jobs: list[Prefill], out: Outbox) -> None:
        for job in jobs:
            try:
                if job.parent is not None and job.parent not in self.contexts:
                    raise EngineError(f"parent context {job.parent!r} does not exist")
                full = (self.contexts[job.parent] if job.parent is not None else []) + list(job.tokens)
                error = self.context_too_long(len(full))
                if error is not None:
                    raise error
                self.contexts[job.ctx] = full
                if isinstance(job, Hold):
                    out.reply(job.reply)
                else:
                    self.prefill_request(job, full)
            except Exception as exc:  # this prefill fails alone
                self.contexts.pop(job.ctx, None)
                out.reply(job.reply, error=self.error(exc))

    def release(self, ctx: ContextId) -> None:
        self.contexts.pop(ctx, None)


def safetensors_model(model_ref: str, key: str, cache_dir: Path) -> Path:
    """The model's directory for an engine that loads safetensors: a GGUF is converted once into the cache,
    as the torch engine does."""
    path = resolve_model(model_ref, key=key)
    if path.is_file() and path.suffix == ".gguf":
        path = convert_gguf(path, cache_dir)
    return path
