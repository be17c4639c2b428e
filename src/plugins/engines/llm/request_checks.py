"""The checks every LLM front makes of a request before it is queued, so that a bad value is refused with a
named error and never fails a core's batch (where it would fail every request in it)."""

from __future__ import annotations

from typing import Any, Sequence

from headrace.plugins.engines.llm.messages import EngineError


def check_token_ids(tokens: Sequence[int], vocab_size: int, engine: str) -> None:
    """Refuse token ids the model has no embedding for, before they can fail a batch (every engine's front)."""
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise EngineError(f"token id {token!r} is not in the vocabulary of engine {engine!r} "
                              f"(0 to {vocab_size - 1})")


MAX_PARTITION = 256  # characters of a cache partition (the daemon sends a 32-character digest)


def check_partition(partition: Any) -> None:
    """Refuse a cache partition that is not a short string before it reaches a core's cache keys."""
    if not isinstance(partition, str) or len(partition) > MAX_PARTITION:
        raise EngineError(f"cache_partition must be a string of at most {MAX_PARTITION} characters")


def check_documents(documents: Any, n_tokens: int) -> tuple[tuple[int, int], ...]:
    """Documents' spans ((start, length) each) in position order, not overlapping, inside the prompt."""
    spans, end = [], 0
    for span in documents:
        if (not isinstance(span, (tuple, list)) or len(span) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in span)):
            raise EngineError(f"a document is a (start, length) pair of integers, not {span!r}")
        start, length = span
        if start < end or length < 1 or start + length > n_tokens:
            raise EngineError(f"document ({start}, {length}) overlaps another or falls outside the prompt's "
                              f"{n_tokens} tokens (documents go in position order)")
        spans.append((start, length))
        end = start + length
    return tuple(spans)


def check_priority(priority: Any) -> None:
    """Refuse a priority that is not an integer before it can fail a core's ordering of its queue."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise EngineError(f"priority must be an integer, not {priority!r}")
