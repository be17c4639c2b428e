"""The one composition root: a config's engines, stores, services and their lifetime, built one way.

The HTTP daemon (``create_app``) and the command line (``headrace run``, ``headrace profile``)
both build their parts here and run them with ``Daemon.serving``, so what a request sees is
what a command sees.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import anyio

from headrace.daemon import heap
from headrace.daemon.collection_registry import CollectionRegistry
from headrace.daemon.config import Config
from headrace.daemon.metrics import Metrics
from headrace.daemon.pool import EnginePool
from headrace.daemon.preload import Preloader
from headrace.graph.service import WorkflowService
from headrace.graph.sessions import SessionManager
from headrace.plugins.manager import Registry, collect
from headrace.private_files import private_data_dir


@dataclass
class Daemon:
    config: Config
    registry: Registry
    metrics: Metrics
    pool: EnginePool
    collections: CollectionRegistry
    workflows: WorkflowService
    sessions: SessionManager

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Daemon]:
        """Load the engines in the background (``pool.wait_loaded`` says when), host runs and sessions, and
        trim malloc's heaps now and then (``[memory] trim_seconds``).

        On leaving, whatever still runs is cancelled (its engine work freed), then the engines stop.
        """
        async with anyio.create_task_group() as engines:
            await engines.start(self.pool.run)
            await engines.start(heap.trim_every, self.config.memory.trim_seconds, self.metrics.malloc_trim_seconds.observe)
            async with self.workflows, anyio.create_task_group() as sessions:
                await sessions.start(self.sessions.run)  # the sessions' runs, and their expiry
                yield self
                sessions.cancel_scope.cancel()
            engines.cancel_scope.cancel()

    def cancel_in_flight(self) -> None:
        """Cancel every run, plain request and session still going (a drain that ran out of time)."""
        self.workflows.cancel_all()
        self.sessions.cancel_all()


def compose(config: Config, registry: Registry | None = None) -> Daemon:
    # First, before anything writes: the data dir 0700 and every file made from now on 0600
    # (the umask is the one switch that reaches LanceDB's and SQLite's own writers too).
    private_data_dir(config.data.data_path())
    registry = registry or collect()
    metrics = Metrics()
    pool = EnginePool(config, registry, metrics)
    collections = CollectionRegistry(config.data.data_path())
    workflows = WorkflowService(registry.workflows, registry.passes, pool.resolve, pool.engines_by_kind,
                                pool.max_efficient_batch, policies=[*registry.batch_policies, *registry.llm_policies],
                                collections=collections.lookup, observer=metrics,
                                calls=Preloader(pool, metrics, config.residency, registry.workflows),
                                id_prefix=config.server.id_prefix,
                                max_traced_steps=config.workflows.max_traced_steps,
                                event_log=config.workflows.run_events, keep_runs=config.workflows.keep_runs,
                                run_history_bytes=int(config.workflows.run_history_mib * 2**20))
    metrics.watch_optimizer(workflows.optimizer.stats)
    metrics.watch_heap(heap.usage)
    metrics.watch_run_history(workflows.history.usage, workflows.history.budget_bytes)
    sessions = SessionManager(workflows.executor, pool.resolve, pool.engines_by_kind, config.sessions.idle_seconds,
                              config.server.id_prefix)
    return Daemon(config, registry, metrics, pool, collections, workflows, sessions)
