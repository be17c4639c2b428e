"""The daemon's parts as a request reaches them: one typed object on the app, read by ``services(request)``.

The composed :class:`~headrace.daemon.compose.Daemon` (config, registry, metrics, pool, collections,
workflows, sessions) is the one source of those parts: ``Services`` carries it and adds only what
the HTTP daemon has on top of it (its lifecycle, per-app state). Routes read the daemon's parts
with ``daemon(request)`` and the rest with ``services(request)``, so a handler's types are checked
and a renamed part fails at import, not in the middle of a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from headrace.batching.programs import ProgramRegistry

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from headrace.daemon.compose import Daemon
    from headrace.daemon.lifecycle import Lifecycle
    from headrace.daemon.responses_store import ResponsesStore


@dataclass
class Services:
    daemon: Daemon
    lifecycle: Lifecycle
    responses: ResponsesStore  # /v1/responses' stored responses
    # named programs' attained service (the las policy's ranks), per daemon
    programs: ProgramRegistry = field(default_factory=ProgramRegistry)
    # /openapi.json, built on its first request: the workflows are fixed once the app exists
    openapi: dict[str, Any] | None = None

    def install(self, app: Starlette) -> None:
        """Put the services on ``app`` as ``app.state.services`` (code that holds the app rather than a
        request, as headrace-ray's replica and tests, reads ``app.state.services.daemon.pool`` and so on)."""
        app.state.services = self


def services(request: Request) -> Services:
    return request.app.state.services


def daemon(request: Request) -> Daemon:
    """The composed daemon's parts (config, registry, metrics, pool, collections, workflows, sessions)."""
    return request.app.state.services.daemon


def owner(request: Request) -> str | None:
    """Whose request this is: the principal of its API key (``APIKeyMiddleware``), None without keys."""
    return getattr(request.state, "principal", None)
