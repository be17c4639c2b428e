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
daemon serves: ``residency.EngineResidency`` decides which and when; the pool runs them.

``health()`` reports both to the liveness check: ``alive`` turns False once a
loop that was serving is dead for good, which a restart of the process may
cure (the systemd watchdog's job). An engine that failed to load at startup is
a problem but not a death: restarting would fail the same way.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Collection

import anyio

from headrace.batching.llm import LLMScheduler
from headrace.batching.resolved import ResolvedEngine
from headrace.batching.requests import runner_for
from headrace.batching.scheduler import BatchScheduler
from headrace.daemon import systemd
from headrace.daemon.config import Config, ConfigError
from headrace.daemon.metrics import Metrics
from headrace.daemon.engine_residency import EngineResidency
from headrace.daemon.slots import EngineSlot
from headrace.plugins.manager import Registry
from headrace.plugins.protocols import EngineEnv, EngineSpec, WorkerHeartbeat

log = logging.getLogger(__name__)

# A crashing scheduler loop restarts after a backoff that doubles per recent crash, up to the cap.
SCHEDULER_BACKOFF_FIRST = 0.05
SCHEDULER_BACKOFF_MAX = 5.0
SCHEDULER_MAX_CRASHES = 5
SCHEDULER_CRASH_WINDOW = 60.0


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
        self.residency = EngineResidency(self.slots, config.residency, metrics, host=self)
        self._tg: anyio.abc.TaskGroup | None = None
        self._started = False
        self._loaded: anyio.Event | None = None  # set once every engine loaded or failed (made by ``run``: events need a loop)

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
        residency = self.residency
        residency.freeze_startup_objects()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            for i, slot in enumerate(self.slots.values()):
                slot.state = "loading"
                systemd.notify(f"STATUS=loading {slot.name} ({slot.plugin}): {i} of {total} engines loaded")
                try:
                    # Under a budget each engine loads once now, which measures it; the engines before it
                    # make room as they would for a request.
                    async with residency.lock:
                        await residency.make_room(slot)
                        await residency.load(slot, "startup")
                except Exception as exc:
                    slot.state, slot.error = "failed", f"{type(exc).__name__}: {exc}"
                    log.exception("engine %s failed to load", slot.name)
                    continue
                slot.scheduler = self._scheduler_for(slot)
                await tg.start(self._supervise_scheduler, slot)
                if slot.state == "loading":  # it may have died already
                    slot.state = "ready"
            if residency.budget:
                await residency.fill_budget()
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
                        raise  # a load failure: ``EngineResidency.load`` records it
                    self.fail(slot, f"the engine stopped: {type(exc).__name__}: {exc}", exc)
                    return
                if not readiness.ready:
                    raise RuntimeError(f"engine {slot.name!r} returned from run() before it was ready")
                self.fail(slot, "the engine stopped: its run() returned while serving", None)
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
                    self.fail(slot, f"the scheduler loop crashed {len(crashes)} times in "
                                     f"{SCHEDULER_CRASH_WINDOW:.0f}s; last: {reason}", exc)
                    return
                log.error("engine %s: scheduler loop crashed, restarting: %s", slot.name, reason, exc_info=exc)
                slot.restarting = reason
                await anyio.sleep(min(SCHEDULER_BACKOFF_MAX, SCHEDULER_BACKOFF_FIRST * 2 ** (len(crashes) - 1)))
                slot.restarting = None

    def fail(self, slot: EngineSlot, reason: str, exc: BaseException | None) -> None:
        slot.state, slot.error, slot.died, slot.restarting = "failed", reason, True, None
        slot.residency = "unloaded"
        self.residency.wake()  # whoever waits for room sees it gone
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
                                     policy=llm_policy(), residency=self.residency.hold_for(slot),
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
            residency=self.residency.hold_for(slot),
        )
        self.metrics.watch(slot.name, running=lambda: 0, waiting=lambda: scheduler.waiting,
                           engine_stats=getattr(engine, "stats", None))
        return scheduler

    # ----- what residency asks of the pool (``residency.ResidencyHost``) ---------------------

    @property
    def serving(self) -> bool:
        return self._tg is not None

    async def start_engine(self, slot: EngineSlot) -> None:
        assert self._tg is not None
        await self._tg.start(self._serve_engine, slot)

    def spawn(self, func: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(func, *args)

    def preload(self, names: Collection[str], after: str | None = None) -> list[str]:
        """The Markov preloader's entry: ``EngineResidency.preload``."""
        return self.residency.preload(names, after)
