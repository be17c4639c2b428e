"""Checks the built-in engines share for their ``[engines.options]`` values; each error names its key."""

from __future__ import annotations

from typing import Any


def positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: must be a positive integer, not {value!r}")
    return value
