"""A Ray Serve replica that is a whole headrace daemon: ``create_app(config)`` with its
lifespan (engines, schedulers, executor, sessions) held open for the replica's life, answering
the requests the ingress forwards by calling the daemon's ASGI app in-process."""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from ray import serve

from headrace.plugins.api import APIError, create_app, load_config
from headrace_ray.keys import PIN_HEADER, id_prefix
from headrace_ray.messages import ForwardedRequest, ResponseStart

log = logging.getLogger(__name__)
RESPONSE_BUFFER = 64  # ASGI messages a replica holds for a slow consumer before the daemon waits


class HeadraceReplica:
    """One daemon. Its run and session ids start with its replica tag (``server.id_prefix``)."""

    async def __init__(self, config: str, overrides: dict[str, Any], ready_timeout_s: float) -> None:
        self.tag = serve.get_replica_context().replica_id.unique_id
        cfg = load_config(Path(config), overrides={**overrides, "server.id_prefix": id_prefix(self.tag)})
        self.app = create_app(cfg)
        self._stop = asyncio.Event()
        # The daemon's lifespan spans the replica's life: entered and left in this one task, which
        # __del__ ends (and a replica whose lifespan ended fails its health check).
        self._lifespan = asyncio.create_task(self._host())
        try:
            with anyio.fail_after(ready_timeout_s):
                # Serve routes to it only once its engines are loaded.
                while not self.app.state.services.lifecycle.ready:
                    if self._lifespan.done():
                        self._lifespan.result()  # raises why it ended
                        raise RuntimeError("the daemon's lifespan ended before it was ready")
                    await asyncio.sleep(0.1)
        except BaseException:  # Serve retries with a new replica: this one's engines go first
            await self.__del__()
            raise
        log.info("replica %s ready", self.tag)

    async def _host(self) -> None:
        async with self.app.router.lifespan_context(self.app):
            await self._stop.wait()

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Answer one request: a ResponseStart, then the body in chunks (streamed as the daemon sends them)."""
        if request.route.owner not in (None, self.tag):  # the router found its owner gone
            error = APIError(404, f"{request.path} is on replica {request.route.owner}, which is gone: runs and "
                                  "sessions live in their replica's memory and ended with it", code="replica_gone")
            response = error.response()
            yield ResponseStart(error.status, [*response.raw_headers, (PIN_HEADER.encode(), self.tag.encode())])
            yield response.body
            return
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "root_path": "", "query_string": request.query, "headers": request.headers,
            "client": request.client, "server": None,
        }
        send_stream, receive_stream = anyio.create_memory_object_stream[dict](RESPONSE_BUFFER)
        gone = asyncio.Event()  # the client went away (the ingress cancelled this call) or the answer ended
        body_read = False

        async def receive() -> dict:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()  # a streaming response listens for the disconnect: it comes only when true
            return {"type": "http.disconnect"}

        async def call() -> None:
            async with send_stream:
                try:
                    await self.app(scope, receive, send_stream.send)
                except Exception:  # the daemon answered it with a 500 already; the traceback goes to the log
                    log.exception("replica %s: %s %s failed", self.tag, request.method, request.path)

        # A task, not a task group: a task group may not span this generator's yields. It is
        # cancelled and awaited in the finally below, whichever way the generator ends.
        task = asyncio.create_task(call())
        try:
            async with receive_stream:
                async for message in receive_stream:
                    if message["type"] == "http.response.start":
                        yield ResponseStart(message["status"],
                                            [*message.get("headers", []), (PIN_HEADER.encode(), self.tag.encode())])
                    elif message["type"] == "http.response.body":
                        if message.get("body"):
                            yield message["body"]
                        if not message.get("more_body", False):
                            break
        finally:
            gone.set()
            if not task.done():
                task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray polls this for the router: the engines loaded here now (residency is a routing input)."""
        slots = self.app.state.services.daemon.pool.slots.values()
        return {"resident": [s.name for s in slots if s.residency == "resident"]}

    def check_health(self) -> None:
        """Ray polls this; raising makes Serve replace the replica (a daemon loop died, or its lifespan ended)."""
        health = self.app.state.services.lifecycle.health()
        if self._lifespan.done() or not health.alive:
            raise RuntimeError(f"replica {self.tag} is unhealthy: {health.problems or 'its lifespan ended'}")

    async def __del__(self) -> None:
        """Serve's shutdown of the replica (after its in-flight requests): the daemon's lifespan ends."""
        self._stop.set()
        try:
            await self._lifespan
        except Exception:
            log.exception("replica %s: its daemon's lifespan failed", self.tag)
