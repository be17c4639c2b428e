"""The HTTP entry: reads each request whole, works out its ``RouteKey`` and forwards it to the
replicas' deployment, whose router picks the replica; streams the answer back as it comes.

Why an ingress of its own rather than Serve's proxy straight to the replicas: a Serve router
sees what the caller passes to ``handle.remote``, and the HTTP proxy passes only the ASGI scope
(the body streams afterwards), so prefix affinity needs a caller that has read the body.
"""

from __future__ import annotations

import json
import logging

from ray.exceptions import RayActorError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from headrace.plugins.api import APIError
from headrace_ray.keys import route_key
from headrace_ray.messages import ForwardedRequest, ResponseStart

log = logging.getLogger(__name__)
REPLICA_FAILED = (RayActorError, RayServeException)  # the replica died, or Serve could not reach it


class HeadraceIngress:
    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int, block_chars: int) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes
        self.block_chars = block_chars

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > self.max_body_bytes:  # the daemon's own limit, checked before the body travels further
            return APIError(413, f"request body is {len(body)} bytes; the limit is {self.max_body_bytes}",
                            code="request_too_large").response()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
        forwarded = ForwardedRequest(
            method=request.method, path=request.url.path, query=request.scope.get("query_string", b""),
            headers=list(request.headers.raw), body=body,
            client=tuple(request.client) if request.client else None,
            route=route_key(request.method, request.url.path, headers, body, self.block_chars))
        stream = self.replicas.handle.remote(forwarded)
        try:
            start = await stream.__anext__()
        except REPLICA_FAILED as exc:
            log.warning("%s %s: its replica failed: %s", request.method, request.url.path, exc)
            return APIError(503, "the replica serving this request died before it answered; a new request goes "
                                 "to a live replica", code="replica_failed").response()
        assert isinstance(start, ResponseStart)
        event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                           for k, v in start.headers)

        async def rest():
            ended = False
            try:
                async for chunk in stream:
                    yield chunk
                ended = True
            except REPLICA_FAILED as exc:
                log.warning("%s %s: its replica failed mid-answer: %s", request.method, request.url.path, exc)
                if event_stream:  # the status is sent already: the error goes in the stream, as the daemon's do
                    error = APIError(503, "the replica serving this stream died", code="replica_failed")
                    yield f"data: {json.dumps(error.body())}\n\n".encode()
            finally:
                # Closed early (the client went away): cancel the replica's call now, not when Ray gets to the
                # request's children (a run a disconnect should cancel once ran to its end: CI, 2026-12-02).
                if not ended:
                    stream.cancel()

        response = StreamingResponse(rest(), status_code=start.status)
        response.raw_headers = list(start.headers)
        return response
