"""Engines loaded and unloaded while the daemon serves, under a memory budget (DyOrc's LRU residency).

With ``[residency] budget_bytes`` set, every engine loads once at startup, which measures its
footprint; afterwards an engine loads when a request needs it (its scheduler's ``hold``), first
unloading the least recently used evictable engines that have nothing in flight, and the Markov
preloader (``preload``) loads predicted engines ahead of their calls. One load or unload runs at a
time. An engine's scheduler outlives its unloads: its queue waits for the reload. Unloading an engine
is cancelling its ``run`` (the ``Reloadable`` protocol); one that is not reloadable is pinned.
Footprints are the engine's own count of its tensor bytes (``Reloadable.footprint_bytes``), or for
other engines the growth of the process's RSS while it loaded. Without a budget every engine stays
loaded.

The engines' tasks belong to the pool's task group; this module decides what loads and unloads, and
asks the pool (``ResidencyHost``) to start an engine or a task.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Literal, Mapping, Protocol

import anyio
import psutil

from headrace.batching.llm import LLMScheduler
from headrace.batching.residency import EngineUnavailable
from headrace.daemon.config import ResidencyConfig
from headrace.daemon.metrics import Metrics
from headrace.daemon.slots import EngineSlot
from headrace.plugins.protocols import Reloadable

log = logging.getLogger(__name__)

# A load that takes longer says so in the log this often.
LOAD_PROGRESS_EVERY = 5.0
# A request waiting for room re-checks this often even when no request ends (a context freed outside one).
ROOM_RECHECK_SECONDS = 0.5
RESIDENCY_HISTORY = 1000  # residency events kept for /v1/models readers and tests

LoadReason = Literal["startup", "demand", "preload"]


@dataclass(frozen=True)
class ResidencyEvent:
    """One load or unload, in ``time.monotonic()`` seconds."""

    at: float
    engine: str
    event: Literal["loaded", "unloaded"]
    reason: str  # loaded: startup | demand | preload; unloaded: evicted | released (``unload_idle``)
    resident_bytes: int  # the loaded engines' footprints together, right after it


class ResidencyHost(Protocol):
    """What residency needs of the pool, which owns the engines' tasks."""

    @property
    def serving(self) -> bool:
        """Its task group is up: engines and tasks can start."""

    async def start_engine(self, slot: EngineSlot) -> None:
        """Run the slot's engine in the pool's task group; return once it is ready (raise if it fails to load)."""

    def spawn(self, func: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a task in the pool's task group."""

    def fail(self, slot: EngineSlot, reason: str, exc: BaseException | None) -> None:
        """Mark the slot's engine failed."""


class EngineResidency:
    """The budget's bookkeeping, and the loads and unloads it decides, over the pool's slots."""

    def __init__(self, slots: Mapping[str, EngineSlot], config: ResidencyConfig, metrics: Metrics,
                 host: ResidencyHost) -> None:
        self.slots = slots
        self.config = config
        self.budget = config.budget_bytes
        self.metrics = metrics
        self._host = host
        for slot in slots.values():
            # Without a budget nothing is ever unloaded (every engine stays loaded, as it always did).
            slot.pinned = not self.budget or slot.name in config.pinned or not reloadable(slot.engine)
            metrics.engine_evictions.labels(slot.name)  # exposed at 0 from the start
            metrics.preloads.labels(slot.name)
            metrics.preload_hits.labels(slot.name)
        self.history: deque[ResidencyEvent] = deque(maxlen=RESIDENCY_HISTORY)
        self.peak_resident_bytes = 0  # the most the loaded engines' footprints ever added up to
        self.lock = anyio.Lock()  # one load or unload at a time
        self._released = anyio.Event()  # set (and replaced) whenever an engine's work ends
        metrics.watch_residency(
            lambda: {s.name: (s.residency == "resident", s.footprint or 0) for s in slots.values()}, self.budget)

    def freeze_startup_objects(self) -> None:
        """Before the first load, under a budget: each unload runs a full collection (``_unload``). The objects
        alive before any engine loads (the imported libraries: about 300,000 with torch and transformers) never
        become garbage; frozen, they are no longer scanned, which halves an unload (0.30 s to 0.16 s measured on
        2 cores)."""
        if self.budget:
            gc.collect()
            gc.freeze()

    def hold_for(self, slot: EngineSlot) -> "SlotResidency":
        """The ``Residency`` the slot's scheduler holds its engine by."""
        return SlotResidency(self, slot)

    def resident_bytes(self) -> int:
        """The footprints of the engines loaded now (or loading, or unloading) together."""
        return sum(s.footprint or 0 for s in self.slots.values() if s.residency != "unloaded")

    def wake(self) -> None:
        """An engine's work ended, or an engine is gone: whoever waits for room looks again."""
        self._released.set()
        self._released = anyio.Event()

    async def acquire(self, slot: EngineSlot) -> None:
        """Wait until ``slot``'s engine is loaded (loading it, making room), and count one use in flight on it."""
        if slot.state == "failed":
            raise EngineUnavailable(f"engine {slot.name!r} failed: {slot.error}")
        if slot.residency == "resident":
            slot.holders += 1
            self._used(slot)
            return
        start = time.monotonic()
        slot.wanting += 1
        try:
            async with self.lock:
                if slot.state == "failed":
                    raise EngineUnavailable(f"engine {slot.name!r} failed: {slot.error}")
                if slot.residency != "resident":
                    wait = self.config.load_wait_seconds
                    try:
                        with anyio.fail_after(wait):
                            await self.make_room(slot)
                    except TimeoutError:
                        raise EngineUnavailable(
                            f"engine {slot.name!r} ({mib(slot.footprint)}) could not be loaded: no room was made for "
                            f"it within {wait:g}s (every evictable engine had work in flight)") from None
                    try:
                        await self.load(slot, "demand")
                    except EngineUnavailable:
                        raise
                    except Exception as exc:
                        self._host.fail(slot, f"its reload failed: {type(exc).__name__}: {exc}", exc)
                        raise EngineUnavailable(f"engine {slot.name!r} could not be loaded: {exc}") from exc
                slot.holders += 1
        finally:
            slot.wanting -= 1
        self.metrics.engine_load_wait_seconds.labels(slot.name).observe(time.monotonic() - start)
        self._used(slot)

    def release(self, slot: EngineSlot) -> None:
        slot.holders -= 1
        slot.last_used = time.monotonic()
        self.wake()

    def preload(self, names: Collection[str], after: str | None = None) -> list[str]:
        """Load these engines ahead of their calls, in this order, within the budget; returns those queued.

        ``after``: the engine being called now; its own load (if it is not loaded) goes first. A
        preload only unloads engines with nothing in flight, nothing queued and no request waiting,
        and neither ``after`` nor one of ``names``; when that does not make room it is skipped.
        Only with a budget.
        """
        if not self.budget or not self._host.serving:
            return []
        protect = frozenset(names) | ({after} if after else set())
        first = self.slots.get(after) if after else None
        queued = []
        for name in names:
            slot = self.slots.get(name)
            if slot is None or slot.state != "ready" or slot.residency != "unloaded" or slot.preloading:
                continue
            slot.preloading = True
            self._host.spawn(self._preload, slot, protect, first)
            queued.append(name)
        return queued

    async def _preload(self, slot: EngineSlot, protect: frozenset[str], first: EngineSlot | None) -> None:
        try:
            # The call being made now waits for its engine: that load goes before this guess.
            with anyio.move_on_after(self.config.load_wait_seconds):
                while first is not None and first.state == "ready" and first.residency != "resident":
                    await anyio.sleep(ROOM_RECHECK_SECONDS / 10)
            async with self.lock:
                if slot.state != "ready" or slot.residency != "unloaded":
                    return  # a request loaded it meanwhile
                if not await self.make_room(slot, protect=protect):
                    log.debug("preload of %s skipped: no idle engine to unload for it", slot.name)
                    return
                await self.load(slot, "preload")
                slot.preloaded = True
                self.metrics.preloads.labels(slot.name).inc()
        except Exception as exc:
            self._host.fail(slot, f"its preload failed: {type(exc).__name__}: {exc}", exc)
        finally:
            slot.preloading = False

    async def unload_idle(self) -> list[str]:
        """Unload every evictable engine that has nothing in flight (the load-per-request baseline of the
        residency benchmark); returns their names."""
        async with self.lock:
            idle = [s for s in self.slots.values() if not s.pinned and s.residency == "resident" and self._idle(s)]
            for slot in idle:
                await self._unload(slot, "released")
        return [s.name for s in idle]

    async def fill_budget(self) -> None:
        """After startup measured every engine (each unmeasured one loaded with the evictable engines
        unloaded), load again, in config order, the evictable ones that fit beside what is loaded."""
        async with self.lock:
            for slot in self.slots.values():
                if (slot.state == "ready" and slot.residency == "unloaded" and slot.footprint is not None
                        and self.resident_bytes() + slot.footprint <= self.budget):
                    try:
                        await self.load(slot, "startup")
                    except Exception as exc:
                        self._host.fail(slot, f"its reload failed: {type(exc).__name__}: {exc}", exc)

    def _used(self, slot: EngineSlot) -> None:
        slot.last_used = time.monotonic()
        if slot.preloaded:
            slot.preloaded = False
            self.metrics.preload_hits.labels(slot.name).inc()

    def _idle(self, slot: EngineSlot) -> bool:
        """Nothing in flight: no batch or request runs on it and no KV context of it is live."""
        contexts = slot.scheduler.contexts if isinstance(slot.scheduler, LLMScheduler) else ()
        return slot.holders == 0 and not contexts

    def _queued(self, slot: EngineSlot) -> bool:
        """Requests wait for it: queued on its scheduler, or waiting for it to load."""
        return slot.wanting > 0 or (slot.scheduler is not None and slot.scheduler.waiting > 0)

    def _lru_idle(self, slot: EngineSlot, protect: frozenset[str] | None = None) -> EngineSlot | None:
        """The least recently used evictable engine other than ``slot`` with nothing in flight; with ``protect``
        (a preload) never one of those, nor one a request waits for."""
        victims = [s for s in self.slots.values() if s is not slot and not s.pinned and s.residency == "resident"
                   and self._idle(s) and (protect is None or (s.name not in protect and not self._queued(s)))]
        return min(victims, key=lambda s: s.last_used, default=None)

    async def make_room(self, slot: EngineSlot, *, protect: frozenset[str] | None = None) -> bool:
        """Unload least recently used idle evictable engines until ``slot`` fits the budget (the lock held).

        On demand (``protect`` None) it waits for engines in flight to finish, and raises
        ``EngineUnavailable`` when nothing could ever make room. A preload (``protect``: the
        predicted engines) unloads only engines nobody waits for, never one of ``protect``,
        and returns False rather than wait. An engine never measured counts as the whole
        budget less the pinned engines: everything evictable goes before it loads.
        """
        if not self.budget:
            return True
        while True:
            others = [s for s in self.slots.values() if s is not slot and s.residency != "unloaded"]
            used = sum(s.footprint or 0 for s in others)
            if slot.footprint is not None:
                fits = used + slot.footprint <= self.budget
            else:
                fits = all(s.pinned for s in others)
            if fits:
                return True
            victim = self._lru_idle(slot, protect)
            if victim is not None:
                await self._unload(victim, "evicted")
                continue
            if protect is not None:
                return False
            if all(s.pinned for s in others):
                pinned = sum(s.footprint or 0 for s in others)
                raise EngineUnavailable(
                    f"engine {slot.name!r} ({mib(slot.footprint)}) does not fit the memory budget of "
                    f"{mib(self.budget)} beside the pinned engines ({mib(pinned)})")
            with anyio.move_on_after(ROOM_RECHECK_SECONDS):
                await self._released.wait()

    async def load(self, slot: EngineSlot, reason: LoadReason) -> None:
        """Run the engine until it is ready (the lock held) and measure its footprint."""
        slot.residency = "loading"
        slot.loads += 1
        why = "" if reason == "startup" else f" ({reason} load" + (
            ")" if slot.footprint is None else f", {mib(slot.footprint)})")
        log.info("loading %s (%s) ...%s", slot.name, slot.plugin, why)
        rss = _rss()
        start = time.monotonic()
        self._host.spawn(self._log_progress, slot, slot.loads, start)
        try:
            await self._host.start_engine(slot)
        except BaseException:
            slot.residency = "unloaded"
            raise
        slot.load_seconds = time.monotonic() - start
        if reloadable(slot.engine):
            slot.footprint, slot.footprint_source = int(slot.engine.footprint_bytes()), "engine"
        else:
            slot.footprint, slot.footprint_source = max(0, _rss() - rss), "rss"
        slot.residency, slot.last_used = "resident", time.monotonic()
        resident = self.resident_bytes()
        self.peak_resident_bytes = max(self.peak_resident_bytes, resident)
        self.history.append(ResidencyEvent(time.monotonic(), slot.name, "loaded", reason, resident))
        self.metrics.engine_loads.labels(slot.name, reason).inc()
        self.metrics.engine_load_seconds.labels(slot.name).observe(slot.load_seconds)
        log.info("loaded %s in %.1f s (%s by %s%s)", slot.name, slot.load_seconds,
                 mib(slot.footprint), "its tensors" if slot.footprint_source == "engine" else "RSS growth",
                 f"; {mib(resident)} of the {mib(self.budget)} budget resident" if self.budget else "")
        if self.budget and resident > self.budget:
            # Measured larger than it was known to be: unload what is idle, or it cannot stay.
            while resident > self.budget:
                victim = self._lru_idle(slot)
                if victim is None:
                    break
                await self._unload(victim, "evicted")
                resident = self.resident_bytes()
            if resident > self.budget:
                if slot.pinned:
                    log.warning("the loaded engines hold %s, over the budget of %s: pinned engine %s is %s",
                                mib(resident), mib(self.budget), slot.name, mib(slot.footprint))
                else:
                    await self._unload(slot, "evicted")
                    raise EngineUnavailable(f"engine {slot.name!r} ({mib(slot.footprint)}) does not fit the memory "
                                            f"budget of {mib(self.budget)} beside the engines in use")

    async def _log_progress(self, slot: EngineSlot, load: int, start: float) -> None:
        while True:
            await anyio.sleep(LOAD_PROGRESS_EVERY)
            if slot.residency != "loading" or slot.loads != load:
                return
            log.info("still loading %s: %.0f s so far", slot.name, time.monotonic() - start)

    async def _unload(self, slot: EngineSlot, reason: str) -> None:
        """Cancel the engine's ``run`` (it releases its model) and wait until it has (the lock held)."""
        slot.residency = "unloading"
        log.info("unloading %s (%s, unused for %.1f s) ...", slot.name, mib(slot.footprint),
                 time.monotonic() - slot.last_used)
        with anyio.CancelScope(shield=True):  # half an unload would leave memory nobody counts
            if slot.unload_scope is not None:
                slot.unload_scope.cancel()
            if slot.stopped is not None:
                await slot.stopped.wait()
            await anyio.to_thread.run_sync(gc.collect)  # the model's reference cycles go now, not at random
        slot.residency, slot.preloaded = "unloaded", False
        self.history.append(ResidencyEvent(time.monotonic(), slot.name, "unloaded", reason, self.resident_bytes()))
        self.metrics.engine_evictions.labels(slot.name).inc()
        log.info("unloaded %s", slot.name)


class SlotResidency:
    """The slot's ``batching.residency.Residency``: its scheduler holds the engine by it."""

    def __init__(self, residency: EngineResidency, slot: EngineSlot) -> None:
        self._residency, self._slot = residency, slot

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        await self._residency.acquire(self._slot)
        try:
            yield
        finally:
            self._residency.release(self._slot)


def reloadable(engine: Any) -> bool:
    return isinstance(engine, Reloadable) and bool(engine.reloadable)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def mib(size: int | None) -> str:
    return "size unknown" if size is None else f"{size / 2**20:.1f} MiB"
