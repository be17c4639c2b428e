"""Shared type aliases, in the spirit of starlette/types.py."""

from __future__ import annotations

from typing import Any, Callable, Mapping

ContextId = str
"""Names one KV context on an LLM engine."""

TokenIds = list[int]

Options = Mapping[str, Any]
"""An engine's free-form options table from the config."""

BatchObserver = Callable[[str, int], None]
"""Called with (operation, batch size) each time an engine runs a batch."""
