"""The engines of one daemon: built from the config, loaded in order, each behind its scheduler.

Every engine's ``run`` and every scheduler loop runs under supervision, so one
that dies never takes the other engines or the HTTP server with it:

- a scheduler loop that raises is logged and restarted after a short backoff
  (its queue survives on the scheduler); after ``SCHEDULER_MAX_CRASHES``
  crashes within ``SCHEDULER_CRASH_WINDOW`` seconds it is given up on, and the
  engine is marked failed;
- an engine whose ``run`` raises or returns after it was ready is marked
  failed with the error (``/ready`` answers 503, requests to it 503).

Under a memory budget (``[residency] budget_bytes``) engines are loaded and unloaded while the
daemon serves (DyOrc's LRU residency): every engine loads once at startup, which measures its
footprint; afterwards an engine loads when a request needs it (its scheduler's ``hold``), first
unloading the least recently used evictable engines that have nothing in flight, and the
Markov preloader (``preload``) loads predicted engines ahead of their calls. One load or unload
runs at a time. An engine's scheduler outlives its unloads: its queue waits for the reload.
Unloading an engine is cancelling its ``run`` (the ``Reloadable`` protocol); one that is not
reloadable is pinned. Footprints are the engine's own count of its tensor bytes
(``Reloadable.footprint_bytes``), or for other engines the growth of the process's RSS while
it loaded.

``health()`` reports both to the liveness check: ``alive`` turns False once a
loop that was serving is dead for good, which a restart of the process may
cure (the systemd watchdog's job). An engine that failed to load at startup is
a problem but not a death: restarting would fail the same way.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Collection, Literal

import anyio
import psutil

from headrace.batching.llm import LLMScheduler
from headrace.batching.protocols import ResolvedEngine
from headrace.batching.requests import runner_for
from headrace.batching.residency import EngineUnavailable
from headrace.batching.scheduler import BatchScheduler
from headrace.daemon import systemd
from headrace.daemon.config import Config, ConfigError
from headrace.daemon.metrics import Metrics
from headrace.plugins.manager import Registry
from headrace.plugins.protocols import EngineEnv, EngineSpec, Reloadable, WorkerHeartbeat

log = logging.getLogger(__name__)

# A crashing scheduler loop restarts after a backoff that doubles per recent crash, up to the cap.
SCHEDULER_BACKOFF_FIRST = 0.05
SCHEDULER_BACKOFF_MAX = 5.0
SCHEDULER_MAX_CRASHES = 5
SCHEDULER_CRASH_WINDOW = 60.0
# A load that takes longer says so in the log this often.
LOAD_PROGRESS_EVERY = 5.0
# A request waiting for room re-checks this often even when no request ends (a context freed outside one).
ROOM_RECHECK_SECONDS = 0.5
RESIDENCY_HISTORY = 1000  # residency events kept for /v1/models readers and tests

ResidencyState = Literal["unloaded", "loading", "resident", "unloading"]
LoadReason = Literal["startup", "demand", "preload"]


@dataclass(frozen=True)
class ResidencyEvent:
    """One load or unload, in ``time.monotonic()`` seconds."""

    at: float
    engine: str
    event: Literal["loaded", "unloaded"]
    reason: str  # loaded: startup | demand | preload; unloaded: evicted | released (``unload_idle``)
    resident_bytes: int  # the loaded engines' footprints together, right after it


@dataclass(frozen=True)
class PoolHealth:
    alive: bool  # False once a loop is dead and not being restarted
    problems: dict[str, str]  # engine name -> what is wrong


class _Readiness:
    """A task status that remembers whether the engine reported ready, and passes it on."""

    def __init__(self, outer: Any) -> None:
        self._outer = outer
        self.ready = False

    def started(self, value: Any = None) -> None:
        self.ready = True
        self._outer.started(value)


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


class EnginePool:
    def __init__(self, config: Config, registry: Registry, metrics: Metrics) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.slots: dict[str, EngineSlot] = {}
        data_dir, cache_dir = config.data.data_path(), config.data.cache_path()
        for i, ec in enumerate(config.engines):
            factory = registry.engines.get(ec.plugin)
            if factory is None:
                known = ", ".join(sorted(registry.engines)) or "none"
                raise ConfigError(f"engines[{i}].plugin", f"no engine plugin {ec.plugin!r} is loaded (loaded: {known})")
            env = EngineEnv(
                data_dir=data_dir,
                cache_dir=cache_dir,
                lookup=self._lookup,
                lookup_scheduled=self._lookup_scheduled,
                observe_batch=metrics.batch_observer(ec.name),
            )
            try:
                engine = factory(EngineSpec(name=ec.name, plugin=ec.plugin, model=ec.model, options=ec.options), env)
            except (ValueError, FileNotFoundError) as exc:
                raise ConfigError(f"engines[{i}]", str(exc)) from exc
            self.slots[ec.name] = EngineSlot(ec.name, ec.plugin, engine)
        self.budget = config.residency.budget_bytes
        for slot in self.slots.values():
            # Without a budget nothing is ever unloaded (every engine stays loaded, as it always did).
            slot.pinned = not self.budget or slot.name in config.residency.pinned or not _reloadable(slot.engine)
            metrics.engine_evictions.labels(slot.name)  # exposed at 0 from the start
            metrics.preloads.labels(slot.name)
            metrics.preload_hits.labels(slot.name)
        self.history: deque[ResidencyEvent] = deque(maxlen=RESIDENCY_HISTORY)
        self.peak_resident_bytes = 0  # the most the loaded engines' footprints ever added up to
        self._residency_lock = anyio.Lock()  # one load or unload at a time
        self._released = anyio.Event()  # set (and replaced) whenever an engine's work ends
        self._tg: anyio.abc.TaskGroup | None = None
        self._started = False
        self._loaded: anyio.Event | None = None  # set once every engine loaded or failed (made by ``run``: events need a loop)
        metrics.watch_residency(
            lambda: {s.name: (s.residency == "resident", s.footprint or 0) for s in self.slots.values()}, self.budget)

    def _lookup(self, name: str) -> Any:
        slot = self.slots.get(name)
        if slot is None or slot.state != "ready":
            raise LookupError(f"engine {name!r} is not configured or not loaded yet (engines load in config order)")
        return slot.engine

    def _lookup_scheduled(self, name: str) -> LLMScheduler:
        slot = self.slots.get(name)
        if slot is None or slot.state != "ready" or not isinstance(slot.scheduler, LLMScheduler):
            raise LookupError(f"LLM engine {name!r} is not configured or not loaded yet (engines load in config order)")
        return slot.scheduler

    def resolve(self, name: str) -> ResolvedEngine:
        """A ready engine and its scheduler, for the graph executor."""
        slot = self.slots.get(name)
        if slot is None or slot.state != "ready" or slot.scheduler is None:
            raise LookupError(f"engine {name!r} is not configured or not ready")
        return ResolvedEngine(slot.engine, slot.scheduler)

    def engines_by_kind(self) -> dict[str, str]:
        """The first ready engine of each kind: a workflow's default engines."""
        out: dict[str, str] = {}
        for slot in self.slots.values():
            if slot.state == "ready":
                out.setdefault(slot.engine.kind, slot.name)
        return out

    def set_llm_policy(self, name: str, policy: str) -> None:
        """Rank the LLM engine ``name``'s requests by ``policy`` from now on (KeyError: no such policy)."""
        slot = self.slots[name]
        if not isinstance(slot.scheduler, LLMScheduler):
            raise TypeError(f"engine {name!r} is not a ready LLM engine")
        slot.scheduler.policy = self.registry.llm_policies[policy]()

    def max_efficient_batch(self, name: str) -> int | None:
        return self.config.batching_for(name).max_efficient_batch_size or None

    @property
    def ready(self) -> bool:
        """Startup is over (every engine loaded once, and under a budget those that fit loaded again) and no
        engine has failed."""
        return self._started and all(s.state == "ready" for s in self.slots.values())

    def health(self) -> PoolHealth:
        """Liveness for /health and the watchdog: dead loops, failed engines, loops restarting."""
        problems = {}
        for slot in self.slots.values():
            if slot.state == "failed":
                problems[slot.name] = slot.error or "failed"
            elif slot.restarting:
                problems[slot.name] = f"scheduler loop restarting after a crash: {slot.restarting}"
        return PoolHealth(alive=not any(s.died for s in self.slots.values()), problems=problems)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Load every engine in config order, start its scheduler, then serve until cancelled.

        Each engine's load is one log line before and one after; systemd's status line says
        which engine loads and how many of them are loaded.
        """
        total = len(self.slots)
        self._loaded = anyio.Event()
        if self.budget:
            # Each unload runs a full collection (below). The objects alive before any engine loads (the
            # imported libraries: about 300,000 with torch and transformers) never become garbage; frozen,
            # they are no longer scanned, which halves an unload (0.30 s to 0.16 s measured on 2 cores).
            gc.collect()
            gc.freeze()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            for i, slot in enumerate(self.slots.values()):
                slot.state = "loading"
                systemd.notify(f"STATUS=loading {slot.name} ({slot.plugin}): {i} of {total} engines loaded")
                try:
                    # Under a budget each engine loads once now, which measures it; the engines before it
                    # make room as they would for a request.
                    async with self._residency_lock:
                        await self._make_room(slot)
                        await self._load(slot, "startup")
                except Exception as exc:
                    slot.state, slot.error = "failed", f"{type(exc).__name__}: {exc}"
                    log.exception("engine %s failed to load", slot.name)
                    continue
                slot.scheduler = self._scheduler_for(slot)
                await tg.start(self._supervise_scheduler, slot)
                if slot.state == "loading":  # it may have died already
                    slot.state = "ready"
            if self.budget:
                await self._fill_budget()
            self._started = True
            self._loaded.set()
            loaded = sum(s.state == "ready" for s in self.slots.values())
            failed = [s.name for s in self.slots.values() if s.state == "failed"]
            systemd.notify(f"STATUS={loaded} of {total} engines loaded"
                           + (f"; failed: {', '.join(failed)}" if failed else "; ready"))
            if self.ready:
                systemd.notify("READY=1")

    async def wait_loaded(self) -> dict[str, str]:
        """Once ``run`` has tried every engine: those that failed to load, and why (empty: all are ready)."""
        if self._loaded is None:
            raise RuntimeError("the pool is not running: start `pool.run` first")
        await self._loaded.wait()
        return {s.name: s.error or "failed" for s in self.slots.values() if s.state == "failed"}

    async def unresponsive(self, within: float) -> dict[str, str]:
        """The ready engines whose worker shows no progress within ``within`` seconds, and why.

        An engine with a worker thread of its own (``WorkerHeartbeat``) must answer a heartbeat
        in that time; a batchable engine's scheduler must not have been running one batch for
        longer. The watchdog calls this at every tick: a wedged engine stops its pings.
        """
        stalled: dict[str, str] = {}

        async def ask(slot: EngineSlot) -> None:
            with anyio.move_on_after(within) as waited:
                try:
                    await slot.engine.heartbeat()
                except Exception as exc:  # its worker died: the pool marks it failed too
                    stalled[slot.name] = f"its worker thread did not answer a heartbeat: {exc}"
            if waited.cancelled_caught:
                stalled[slot.name] = f"its worker thread has not answered a heartbeat in {within:g}s"

        now = time.monotonic()
        async with anyio.create_task_group() as tg:
            for slot in self.slots.values():
                if slot.state != "ready" or slot.residency != "resident":  # an unloaded engine has no worker
                    continue
                if isinstance(slot.engine, WorkerHeartbeat):
                    tg.start_soon(ask, slot)
                if isinstance(slot.scheduler, BatchScheduler) and slot.scheduler.busy_since is not None:
                    running = now - slot.scheduler.busy_since
                    if running > within:
                        stalled[slot.name] = f"one batch has been running for {running:.1f}s"
        return stalled

    async def _serve_engine(self, slot: EngineSlot, *, task_status: Any) -> None:
        """The engine's ``run``; once it was ready, its end fails this slot only, unless it was unloaded."""
        readiness = _Readiness(task_status)
        stopped = slot.stopped = anyio.Event()
        try:
            with anyio.CancelScope() as slot.unload_scope:
                try:
                    await slot.engine.run(task_status=readiness)
                except Exception as exc:
                    if not readiness.ready:
                        raise  # a load failure: ``_load`` records it
                    self._fail(slot, f"the engine stopped: {type(exc).__name__}: {exc}", exc)
                    return
                if not readiness.ready:
                    raise RuntimeError(f"engine {slot.name!r} returned from run() before it was ready")
                self._fail(slot, "the engine stopped: its run() returned while serving", None)
        finally:
            slot.unload_scope = None
            stopped.set()

    async def _supervise_scheduler(self, slot: EngineSlot, *, task_status: Any) -> None:
        """Run the scheduler loop; restart it when it raises, give up when it keeps crashing."""
        readiness = _Readiness(task_status)
        crashes: deque[float] = deque()
        while True:
            try:
                await slot.scheduler.run(task_status=readiness if not readiness.ready else anyio.TASK_STATUS_IGNORED)
                if not readiness.ready:
                    readiness.started()
                return  # a loop that returns has nothing left to do (LLM admission has no loop)
            except Exception as exc:
                if not readiness.ready:
                    readiness.started()  # the restart below is the supervisor's business, not the loader's
                now = time.monotonic()
                crashes.append(now)
                while crashes and crashes[0] < now - SCHEDULER_CRASH_WINDOW:
                    crashes.popleft()
                self.metrics.scheduler_restarts.labels(slot.name).inc()
                reason = f"{type(exc).__name__}: {exc}"
                if len(crashes) >= SCHEDULER_MAX_CRASHES:
                    self._fail(slot, f"the scheduler loop crashed {len(crashes)} times in "
                                     f"{SCHEDULER_CRASH_WINDOW:.0f}s; last: {reason}", exc)
                    return
                log.error("engine %s: scheduler loop crashed, restarting: %s", slot.name, reason, exc_info=exc)
                slot.restarting = reason
                await anyio.sleep(min(SCHEDULER_BACKOFF_MAX, SCHEDULER_BACKOFF_FIRST * 2 ** (len(crashes) - 1)))
                slot.restarting = None

    def _fail(self, slot: EngineSlot, reason: str, exc: BaseException | None) -> None:
        slot.state, slot.error, slot.died, slot.restarting = "failed", reason, True, None
        slot.residency = "unloaded"
        self._released.set()  # whoever waits for room sees it gone
        self._released = anyio.Event()
        self.metrics.engine_failures.labels(slot.name).inc()
        log.error("engine %s failed: %s", slot.name, reason, exc_info=exc)

    def _scheduler_for(self, slot: EngineSlot) -> BatchScheduler | LLMScheduler:
        batching = self.config.batching_for(slot.name)
        engine = slot.engine
        if engine.kind == "llm":
            override = self.config.engine(slot.name).batching
            # An LLM engine's own `policy` names an LLM policy; otherwise the global llm_policy applies.
            key, name = ((f"engines.{slot.name}.batching.policy", override.policy) if override and override.policy
                         else ("batching.llm_policy", batching.llm_policy))
            llm_policy = self.registry.llm_policies.get(name)
            if llm_policy is None:
                raise ConfigError(key, f"no LLM policy {name!r} is registered; known: {sorted(self.registry.llm_policies)}")
            scheduler = LLMScheduler(engine, max_running=batching.max_running, max_runs=batching.max_runs,
                                     observer=self.metrics,
                                     policy=llm_policy(), residency=_SlotResidency(self, slot),
                                     policies={n: f() for n, f in self.registry.llm_policies.items()})
            stats = getattr(engine, "stats", None)
            self.metrics.watch(
                slot.name,
                running=lambda: scheduler.running,
                waiting=lambda: scheduler.waiting,
                contexts=(lambda: stats()["contexts"]) if stats else None,
                engine_stats=stats,
            )
            return scheduler
        policy_factory = self.registry.batch_policies.get(batching.policy)
        if policy_factory is None:
            raise ConfigError("batching.policy", f"no batch policy {batching.policy!r} is registered")
        scheduler = BatchScheduler(
            slot.name,
            runner_for(engine),
            policy_factory(),
            max_batch_size=batching.max_batch_size,
            max_wait_ms=batching.max_wait_ms,
            observer=self.metrics,
            policies={name: factory() for name, factory in self.registry.batch_policies.items()},
            residency=_SlotResidency(self, slot),
        )
        self.metrics.watch(slot.name, running=lambda: 0, waiting=lambda: scheduler.waiting,
                           engine_stats=getattr(engine, "stats", None))
        return scheduler


    # ----- residency under the memory budget ------------------------------------------------

    def resident_bytes(self) -> int:
        """The footprints of the engines loaded now (or loading, or unloading) together."""
        return sum(s.footprint or 0 for s in self.slots.values() if s.residency != "unloaded")

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
            async with self._residency_lock:
                if slot.state == "failed":
                    raise EngineUnavailable(f"engine {slot.name!r} failed: {slot.error}")
                if slot.residency != "resident":
                    wait = self.config.residency.load_wait_seconds
                    try:
                        with anyio.fail_after(wait):
                            await self._make_room(slot)
                    except TimeoutError:
                        raise EngineUnavailable(
                            f"engine {slot.name!r} ({_mib(slot.footprint)}) could not be loaded: no room was made for "
                            f"it within {wait:g}s (every evictable engine had work in flight)") from None
                    try:
                        await self._load(slot, "demand")
                    except EngineUnavailable:
                        raise
                    except Exception as exc:
                        self._fail(slot, f"its reload failed: {type(exc).__name__}: {exc}", exc)
                        raise EngineUnavailable(f"engine {slot.name!r} could not be loaded: {exc}") from exc
                slot.holders += 1
        finally:
            slot.wanting -= 1
        self.metrics.engine_load_wait_seconds.labels(slot.name).observe(time.monotonic() - start)
        self._used(slot)

    def release(self, slot: EngineSlot) -> None:
        slot.holders -= 1
        slot.last_used = time.monotonic()
        self._released.set()
        self._released = anyio.Event()

    def preload(self, names: Collection[str], after: str | None = None) -> list[str]:
        """Load these engines ahead of their calls, in this order, within the budget; returns those queued.

        ``after``: the engine being called now; its own load (if it is not loaded) goes first. A
        preload only unloads engines with nothing in flight, nothing queued and no request waiting,
        and neither ``after`` nor one of ``names``; when that does not make room it is skipped.
        Only with a budget.
        """
        if not self.budget or self._tg is None:
            return []
        protect = frozenset(names) | ({after} if after else set())
        first = self.slots.get(after) if after else None
        queued = []
        for name in names:
            slot = self.slots.get(name)
            if slot is None or slot.state != "ready" or slot.residency != "unloaded" or slot.preloading:
                continue
            slot.preloading = True
            self._tg.start_soon(self._preload, slot, protect, first)
            queued.append(name)
        return queued

    async def _preload(self, slot: EngineSlot, protect: frozenset[str], first: EngineSlot | None) -> None:
        try:
            # The call being made now waits for its engine: that load goes before this guess.
            with anyio.move_on_after(self.config.residency.load_wait_seconds):
                while first is not None and first.state == "ready" and first.residency != "resident":
                    await anyio.sleep(ROOM_RECHECK_SECONDS / 10)
            async with self._residency_lock:
                if slot.state != "ready" or slot.residency != "unloaded":
                    return  # a request loaded it meanwhile
                if not await self._make_room(slot, protect=protect):
                    log.debug("preload of %s skipped: no idle engine to unload for it", slot.name)
                    return
                await self._load(slot, "preload")
                slot.preloaded = True
                self.metrics.preloads.labels(slot.name).inc()
        except Exception as exc:
            self._fail(slot, f"its preload failed: {type(exc).__name__}: {exc}", exc)
        finally:
            slot.preloading = False

    async def unload_idle(self) -> list[str]:
        """Unload every evictable engine that has nothing in flight (the load-per-request baseline of the
        residency benchmark); returns their names."""
        async with self._residency_lock:
            idle = [s for s in self.slots.values() if not s.pinned and s.residency == "resident" and self._idle(s)]
            for slot in idle:
                await self._unload(slot, "released")
        return [s.name for s in idle]

    async def _fill_budget(self) -> None:
        """After startup measured every engine (each unmeasured one loaded with the evictable engines
        unloaded), load again, in config order, the evictable ones that fit beside what is loaded."""
        async with self._residency_lock:
            for slot in self.slots.values():
                if (slot.state == "ready" and slot.residency == "unloaded" and slot.footprint is not None
                        and self.resident_bytes() + slot.footprint <= self.budget):
                    try:
                        await self._load(slot, "startup")
                    except Exception as exc:
                        self._fail(slot, f"its reload failed: {type(exc).__name__}: {exc}", exc)

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

    async def _make_room(self, slot: EngineSlot, *, protect: frozenset[str] | None = None) -> bool:
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
            victims = [s for s in others if not s.pinned and s.residency == "resident" and self._idle(s)
                       and (protect is None or (s.name not in protect and not self._queued(s)))]
            if victims:
                await self._unload(min(victims, key=lambda s: s.last_used), "evicted")
                continue
            if protect is not None:
                return False
            if all(s.pinned for s in others):
                pinned = sum(s.footprint or 0 for s in others)
                raise EngineUnavailable(
                    f"engine {slot.name!r} ({_mib(slot.footprint)}) does not fit the memory budget of "
                    f"{_mib(self.budget)} beside the pinned engines ({_mib(pinned)})")
            with anyio.move_on_after(ROOM_RECHECK_SECONDS):
                await self._released.wait()

    async def _load(self, slot: EngineSlot, reason: LoadReason) -> None:
        """Run the engine until it is ready (the lock held) and measure its footprint."""
        assert self._tg is not None
        slot.residency = "loading"
        slot.loads += 1
        why = "" if reason == "startup" else f" ({reason} load" + (
            ")" if slot.footprint is None else f", {_mib(slot.footprint)})")
        log.info("loading %s (%s) ...%s", slot.name, slot.plugin, why)
        rss = _rss()
        start = time.monotonic()
        self._tg.start_soon(self._log_progress, slot, slot.loads, start)
        try:
            await self._tg.start(self._serve_engine, slot)
        except BaseException:
            slot.residency = "unloaded"
            raise
        slot.load_seconds = time.monotonic() - start
        if _reloadable(slot.engine):
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
                 _mib(slot.footprint), "its tensors" if slot.footprint_source == "engine" else "RSS growth",
                 f"; {_mib(resident)} of the {_mib(self.budget)} budget resident" if self.budget else "")
        if self.budget and resident > self.budget:
            # Measured larger than it was known to be: unload what is idle, or it cannot stay.
            while resident > self.budget:
                victims = [s for s in self.slots.values() if s is not slot and not s.pinned
                           and s.residency == "resident" and self._idle(s)]
                if not victims:
                    break
                await self._unload(min(victims, key=lambda s: s.last_used), "evicted")
                resident = self.resident_bytes()
            if resident > self.budget:
                if slot.pinned:
                    log.warning("the loaded engines hold %s, over the budget of %s: pinned engine %s is %s",
                                _mib(resident), _mib(self.budget), slot.name, _mib(slot.footprint))
                else:
                    await self._unload(slot, "evicted")
                    raise EngineUnavailable(f"engine {slot.name!r} ({_mib(slot.footprint)}) does not fit the memory "
                                            f"budget of {_mib(self.budget)} beside the engines in use")

    async def _log_progress(self, slot: EngineSlot, load: int, start: float) -> None:
        while True:
            await anyio.sleep(LOAD_PROGRESS_EVERY)
            if slot.residency != "loading" or slot.loads != load:
                return
            log.info("still loading %s: %.0f s so far", slot.name, time.monotonic() - start)

    async def _unload(self, slot: EngineSlot, reason: str) -> None:
        """Cancel the engine's ``run`` (it releases its model) and wait until it has (the lock held)."""
        slot.residency = "unloading"
        log.info("unloading %s (%s, unused for %.1f s) ...", slot.name, _mib(slot.footprint),
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


class _SlotResidency:
    """The ``Residency`` a slot's scheduler holds its engine by."""

    def __init__(self, pool: EnginePool, slot: EngineSlot) -> None:
        self._pool, self._slot = pool, slot

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        await self._pool.acquire(self._slot)
        try:
            yield
        finally:
            self._pool.release(self._slot)


def _reloadable(engine: Any) -> bool:
    return isinstance(engine, Reloadable) and bool(engine.reloadable)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _mib(size: int | None) -> str:
    return "size unknown" if size is None else f"{size / 2**20:.1f} MiB"
