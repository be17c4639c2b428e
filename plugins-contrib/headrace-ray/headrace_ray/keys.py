"""What the router needs to know about one HTTP request, read at the ingress (the router never
sees the body: Serve's HTTP proxy hands a router only the ASGI scope).

Ownership is encoded in the ids, not kept in a shared table: each replica runs its daemon with
``server.id_prefix = "<replica tag>_"``, so a run id reads ``<tag>_<hex>`` and a session id
``sess_<tag>_<hex>``. A table would be one more piece of state to replicate and to lose with the
process that held it; an id carries its owner wherever the client takes it, and a replica that
dies takes its runs with it, which its tag (never reused: Serve gives a restarted replica a new
one) then says.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

PIN_HEADER = "x-headrace-replica"  # a request naming a replica goes there; every response names its replica
BLOCK_CHARS = 256  # the prompt text is hashed in blocks of this many characters
_ROUTE = re.compile(r"^/v1/(runs|sessions)/([^/]+)")


def id_prefix(tag: str) -> str:
    """The ``server.id_prefix`` of the replica tagged ``tag``."""
    return f"{tag}_"


def owner_of(kind: str, id_: str) -> str | None:
    """The tag of the replica that minted a run (``kind="runs"``) or session id; None for an id with none."""
    if kind == "sessions":
        id_ = id_.removeprefix("sess_")
    tag, sep, _ = id_.rpartition("_")
    return tag if sep and tag else None


@dataclass(frozen=True)
class RouteKey:
    """The routing inputs of one request."""

    owner: str | None = None  # the replica that must serve it (its run or session lives there)
    prefix_blocks: tuple[str, ...] = ()  # chained hashes of the prompt's leading blocks: equal up to where it differs
    engines: tuple[str, ...] = ()  # the engines it names (a `model`): a replica where they are resident is preferred


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS) -> tuple[str, ...]:
    """One hash per whole block of ``text``, each covering every block before it too.

    Two prompts share their first k hashes exactly when they share their first k blocks, so
    a replica's longest match is the deepest of its hashes the prompt has. Characters, not
    tokens: the ingress has no tokenizer, and equal text tokenizes equally on every replica.
    """
    out: list[str] = []
    digest = hashlib.blake2b(digest_size=12)
    for start in range(0, len(text) - block_chars + 1, block_chars):
        digest.update(text[start:start + block_chars].encode())
        out.append(digest.copy().hexdigest())
    return tuple(out)


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The text a request's prompt starts with, as far as the ingress can tell from the body."""
    if path == "/v1/chat/completions":
        parts = []
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                break
            content = message.get("content")
            if isinstance(content, list):  # content parts: their text, in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role')}>{content if isinstance(content, str) else ''}")
        return "".join(parts)
    if path == "/v1/completions":
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else ""
    if path.startswith("/v1/workflows/") and path.endswith("/runs"):
        # A workflow's prompts are built from its inputs: equal inputs, equal prompt prefixes.
        return path + json.dumps(body.get("inputs"), sort_keys=True, default=str)
    return ""


def route_key(method: str, path: str, headers: dict[str, str], body: bytes,
              block_chars: int = BLOCK_CHARS) -> RouteKey:
    """The routing inputs of a request to the daemon's API (``headers`` lower-cased)."""
    if pinned := headers.get(PIN_HEADER):
        return RouteKey(owner=pinned)
    if match := _ROUTE.match(path):
        owner = owner_of(match[1], match[2])
        if owner is not None:
            return RouteKey(owner=owner)
    if method != "POST" or not body:
        return RouteKey()
    try:
        parsed = json.loads(body)
    except ValueError:
        return RouteKey()  # the replica answers the 400
    if not isinstance(parsed, dict):
        return RouteKey()
    model = parsed.get("model")
    return RouteKey(prefix_blocks=prefix_blocks(prompt_text(path, parsed), block_chars),
                    engines=(model,) if isinstance(model, str) else ())
