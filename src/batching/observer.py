"""What schedulers report as requests move through them; the daemon turns it into metrics."""

from __future__ import annotations

from typing import Protocol


class SchedulerObserver(Protocol):
    def queued(self, engine: str) -> None: ...

    def started(self, engine: str, queue_seconds: float) -> None: ...

    def first_token(self, engine: str, seconds: float) -> None: ...

    def next_token(self, engine: str, seconds: float) -> None: ...

    def finished(self, engine: str, seconds: float, prompt_tokens: int, generation_tokens: int,
                 finish_reason: str, cached_tokens: int = 0) -> None:
        """A request ended: ``finish_reason`` is ``stop`` or ``length`` (an LLM's; ``stop`` for other engines),
        ``abort`` (cancelled or abandoned) or ``error`` (it failed); ``cached_tokens``: of the prompt's, those found
        cached (the engine's cells or a KV tier), not prefilled."""
        ...


class NullObserver:
    def queued(self, engine: str) -> None:
        pass

    def started(self, engine: str, queue_seconds: float) -> None:
        pass

    def first_token(self, engine: str, seconds: float) -> None:
        pass

    def next_token(self, engine: str, seconds: float) -> None:
        pass

    def finished(self, engine: str, seconds: float, prompt_tokens: int, generation_tokens: int,
                 finish_reason: str, cached_tokens: int = 0) -> None:
        pass
