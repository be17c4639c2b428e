"""What the ingress and a replica send each other through a deployment handle."""

from __future__ import annotations

from dataclasses import dataclass, field

from headrace_ray.keys import RouteKey


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request, read whole at the ingress, for a replica's daemon to answer."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    route: RouteKey = field(default_factory=RouteKey)  # what the router reads


@dataclass(frozen=True)
class ResponseStart:
    """A replica's answer begins: status and headers. Body chunks (bytes) follow it in the stream."""

    status: int
    headers: list[tuple[bytes, bytes]]
