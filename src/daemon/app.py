"""The starlette application: routes, API-key check, readiness, and the engines' lifetime."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from headrace import __version__
from headrace.daemon import systemd
from headrace.daemon.compose import compose
from headrace.daemon.config import Config
from headrace.daemon.errors import APIError, api_error_handler, internal_error_handler
from headrace.daemon.lifecycle import DrainMiddleware, Lifecycle
from headrace.daemon.openapi import openapi_json
from headrace.daemon.ownership import principal
from headrace.daemon.responses_store import ResponsesStore
from headrace.daemon.docs import docs_asset, docs_page
from headrace.daemon.routes import API_ROUTES
from headrace.daemon.services import Services, daemon, services
from headrace.plugins.manager import Registry


class APIKeyMiddleware:
    """Bearer check on /v1/*; plain ASGI so streaming responses pass through untouched.

    Any configured key is accepted; the request's ``state["principal"]`` then names its key
    (what it creates belongs to it: ``headrace.daemon.ownership``). Without keys there is no auth
    and the principal is None for all.
    """

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.principals = [(key.encode(), principal(key)) for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.principals and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auths = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
            if len(auths) > 1:
                # 400, not 401: the request is malformed (one credential per request, RFC 9110),
                # and a proxy and client disagreeing on which header counts is how keys get confused.
                await APIError(400, "more than one Authorization header", param="Authorization",
                               code="duplicate_authorization").response()(scope, receive, send)
                return
            auth = auths[0] if auths else b""
            scheme, _, token = auth.partition(b" ")
            who = None
            if scheme.lower() == b"bearer":
                for key, owner in self.principals:  # every key is compared: the time says nothing of which matched
                    if hmac.compare_digest(token.strip(), key):
                        who = owner
            if who is None:
                message = "missing API key" if not auth else "incorrect API key"
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
                return
            scope.setdefault("state", {})["principal"] = who
        await self.app(scope, receive, send)


async def health(request: Request) -> Response:
    """Liveness: 503 once a loop the daemon needs is dead, so a watchdog or probe restarts it."""
    state = services(request).lifecycle.health()
    body = {"status": "ok" if state.alive else "unhealthy", "version": __version__,
            **({"problems": state.problems} if state.problems else {})}
    return JSONResponse(body, status_code=200 if state.alive else 503)


async def ready(request: Request) -> Response:
    """Readiness: 503 while an engine is not ready or the daemon drains."""
    pool, lifecycle = daemon(request).pool, services(request).lifecycle
    engines = {
        s.name: {"state": s.state, **({"error": s.error} if s.error else {}),
                 **({"load_seconds": round(s.load_seconds, 3)} if s.load_seconds is not None else {})}
        for s in pool.slots.values()
    }
    return JSONResponse({"ready": lifecycle.ready, "draining": lifecycle.draining, "engines": engines,
                         "in_flight": lifecycle.in_flight_counts()},
                        status_code=200 if lifecycle.ready else 503)


async def metrics(request: Request) -> Response:
    return Response(daemon(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def not_found(request: Request, exc: Exception) -> Response:
    return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                    code="method_not_allowed").response()


def create_app(config: Config, registry: Registry | None = None) -> Starlette:
    composed = compose(config, registry)
    lifecycle = Lifecycle(composed.pool, composed.workflows, config.server.drain_seconds)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        # The engines load in the background: /health answers at once, /ready once all are loaded.
        try:
            async with composed.serving(), anyio.create_task_group() as tg:
                # On SIGTERM the lifecycle lets runs finish (the server stops only once it has
                # drained); on leaving, only what outlived the drain, or a host that does not
                # drain (the test client), leaves runs to cancel.
                await tg.start(lifecycle.run, composed.cancel_in_flight)
                yield
                systemd.notify("STOPPING=1")
                tg.cancel_scope.cancel()
        finally:
            lifecycle.serving = False  # e.g. a crashed loop ended the task groups: /health turns 503

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/ready", ready),
            Route("/metrics", metrics),
            Route("/openapi.json", openapi_json),
            Route("/docs", docs_page),
            Route("/docs/assets/{file}", docs_asset),
            *API_ROUTES,
        ],
        exception_handlers={APIError: api_error_handler, 404: not_found, 405: method_not_allowed,
                            Exception: internal_error_handler},
        lifespan=lifespan,
    )
    responses = ResponsesStore(config.data.data_path(), config.responses.max_age_seconds)
    Services(composed, lifecycle, responses).install(app)
    app.add_middleware(APIKeyMiddleware, api_keys=config.server.keys())
    app.add_middleware(DrainMiddleware, lifecycle=lifecycle)  # outermost: a drain refuses before anything
    return app

