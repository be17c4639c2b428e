"""The daemon's services as a request reaches them: one typed object on the app, read by ``services(request)``.

Routes and probes take the pool, the workflow service and the rest from here, so a handler's
types are checked and a renamed service fails at import, not in the middle of a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from headrace.batching.programs import ProgramRegistry

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from headrace.daemon.collection_registry import CollectionRegistry
    from headrace.daemon.config import Config
    from headrace.daemon.lifecycle import Lifecycle
    from headrace.daemon.metrics import Metrics
    from headrace.daemon.pool import EnginePool
    from headrace.graph.service import WorkflowService
    from headrace.graph.sessions import SessionManager
    from headrace.plugins.manager import Registry


@dataclass
class Services:
    config: Config
    registry: Registry
    metrics: Metrics
    pool: EnginePool
    collections: CollectionRegistry
    workflows: WorkflowService
    sessions: SessionManager
    lifecycle: Lifecycle
    # named programs' attained service (the las policy's ranks), per daemon
    programs: ProgramRegistry = field(default_factory=ProgramRegistry)
    # /openapi.json, built on its first request: the workflows are fixed once the app exists
    openapi: dict[str, Any] | None = None

    def install(self, app: Starlette) -> None:
        """Put the services on ``app``: as ``app.state.services``, and each as ``app.state.<name>`` for
        code that holds the app rather than a request (headrace-ray's replica, tests)."""
        app.state.services = self
        for f in fields(self):
            if f.name != "openapi":
                setattr(app.state, f.name, getattr(self, f.name))


def services(request: Request) -> Services:
    return request.app.state.services


def owner(request: Request) -> str | None:
    """Whose request this is: the principal of its API key (``APIKeyMiddleware``), None without keys."""
    return getattr(request.state, "principal", None)
