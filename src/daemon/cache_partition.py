"""Which cached KV a request may reuse: its cache partition (issue 50, after vLLM's ``cache_salt``).

A prompt found cached answers sooner, and its usage counts ``cached_tokens``: a client can tell whether
someone sent a prefix before (CVE-2025-46570). So a request reuses only the KV that requests of its own
partition left, in every cache an engine keeps (prefix cache, retained program contexts, KV tiers in host
memory and on disk). Its partition is made of:

- its API key's principal, when the daemon keeps keys apart: several keys and ``[server]
  share_cache_across_keys`` false, the default;
- its ``cache_salt``, when it sends one: requests with the same salt share (vLLM's semantics).

With neither (one key or none, no salt) it is "", the shared partition: caching as before any of this,
at no cost. Otherwise a digest of both, so an engine (and a KV file's header) holds no key nor salt.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from starlette.requests import Request

from headrace.daemon.errors import bad_request
from headrace.daemon.services import daemon, owner
from headrace.plugins.protocols import IsolatesCaches


def partition_of(principal: str | None, salt: str | None) -> str:
    """The partition of a request from ``principal`` (None: keys are shared or absent) with ``salt``."""
    if principal is None and salt is None:
        return ""
    # JSON keeps the two apart: no salt can pose as a principal, nor "" as no salt.
    return hashlib.blake2b(json.dumps([principal, salt]).encode(), digest_size=16).hexdigest()


def cache_partition(request: Request, salt: str | None = None, engine: Any = None) -> str:
    """The partition of ``request`` (its key, as configured) sending ``salt`` to ``engine``; a 400 for a salt
    the engine cannot honour (it keeps a cache it cannot partition)."""
    if salt is not None and engine is not None and not (isinstance(engine, IsolatesCaches)
                                                        and engine.isolates_caches):
        raise bad_request("this model's engine cannot keep its cached KV apart by cache_salt", param="cache_salt",
                          code="unsupported_parameter")
    keyed = daemon(request).config.server.caches_per_key()
    return partition_of(owner(request) if keyed else None, salt)
