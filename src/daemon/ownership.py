"""Who owns what, for every route: the one rule (docs/deploy.md#what-each-api-key-owns).

A request's *caller* is the principal of its API key (a digest, ``principal``; the key itself is never
stored), or None when no keys are configured. What a request creates records its caller as its
``owner``: a workflow run, a session (and its run), a stored response, a collection. Another caller
finds it absent: 404 on read, on ``previous_response_id``, on delete and on change, and left out of
lists, with the same message as an id that never existed, so an id says nothing of whom it belongs to.

Without keys every caller is None, so everything is everyone's, as a single-user daemon wants.

One exception, collections made with no owner (while no keys were configured, or before collections
had owners): they are *public*, read and searched by every key, and changed by none while keys are
configured, so an operator can build a shared corpus and then turn keys on.

Engines, models and workflows are shared: they hold no caller's data. Cached KV follows the caches'
own rule (``headrace.daemon.cache_partition``, ``server.share_cache_across_keys``), not this one: its
entries are never listed or read back, only reused.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, TypeVar

from starlette.requests import Request

from headrace.daemon.services import owner as caller


class Owned(Protocol):
    owner: str | None


T = TypeVar("T", bound=Owned)


def principal(api_key: str) -> str:
    """Who holds ``api_key``, as owners are recorded: a digest, so the key itself is never stored."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def owns(owner: str | None, who: str | None) -> bool:
    """Whether ``who`` owns what ``owner`` created (None and None: no keys, one owner for all)."""
    return owner == who


def may_read(owner: str | None, who: str | None, public: bool = False) -> bool:
    """Whether ``who`` may read what ``owner`` created; ``public``: a thing with no owner is everyone's
    (collections)."""
    return owns(owner, who) or (public and owner is None)


def mine(request: Request, thing: T | None) -> T | None:
    """``thing`` if the request's caller owns it, else None: the route answers 404 as for a missing id."""
    return thing if thing is not None and owns(thing.owner, caller(request)) else None


def readable(request: Request, thing: T | None) -> T | None:
    """``thing`` if the caller may read it: its own, or public (no owner; collections)."""
    return thing if thing is not None and may_read(thing.owner, caller(request), public=True) else None


def read_only(request: Request, thing: Owned) -> bool:
    """A public thing the caller may read but not change: while keys are configured, nobody changes it."""
    return not owns(thing.owner, caller(request))


__all__ = ["Owned", "caller", "may_read", "mine", "owns", "principal", "read_only", "readable"]
