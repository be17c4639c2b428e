"""Shared type aliases, in the spirit of starlette/types.py."""

from __future__ import annotations

from typing import Any, Callable, Mapping

ContextId = str
"""Names one KV context on an LLM engine."""

TokenIds = list[int]

Options = Mapping[str, Any]
"""An engine's free-form options table from the config."""

BatchObserver = Callable[[str, int, float, float], None]
"""Called with (operation, batch size, start, end) after an engine computes a batch.

Times come from ``time.monotonic()``: they become the batch-size metrics and the
engine rows of a run's timeline (where the engine computed, and where it waited).
"""
