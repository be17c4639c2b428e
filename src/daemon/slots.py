"""One configured engine as the pool holds it: the engine, its scheduler, its state and its residency."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from headrace.batching.llm import LLMScheduler
from headrace.batching.scheduler import BatchScheduler

ResidencyState = Literal["unloaded", "loading", "resident", "unloading"]


@dataclass
class EngineSlot:
    name: str
    plugin: str
    engine: Any
    scheduler: BatchScheduler | LLMScheduler | None = None
    state: str = "pending"  # pending | loading | ready | failed
    error: str | None = None
    load_seconds: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    died: bool = False  # its engine or scheduler loop stopped after it was serving
    # A program's context pinned across its tool calls (daemon.retention); PATCH /v1/engines/{engine} switches it.
    retention: bool = True
    restarting: str | None = None  # the scheduler loop's last crash, while it waits to restart
    # Residency (``state`` stays "ready" while an engine that loaded once is unloaded: requests wait for it).
    pinned: bool = True  # never unloaded (no budget, configured so, or the engine cannot unload)
    residency: ResidencyState = "unloaded"
    footprint: int | None = None  # bytes, measured at its last load; None before the first
    footprint_source: Literal["engine", "rss"] | None = None
    holders: int = 0  # batches or LLM requests running on it now
    wanting: int = 0  # requests waiting for it to load
    last_used: float = 0.0  # time.monotonic() of its last use: the LRU order
    loads: int = 0
    preloaded: bool = False  # loaded by a prediction and not used since
    preloading: bool = False  # a preload of it is queued or running
    unload_scope: anyio.CancelScope | None = None  # cancels its run(): the unload
    stopped: anyio.Event | None = None  # set when its run() has returned
