"""Pins from the chat route: a program's context kept across its tool calls, clients' ``cache_control`` marks.

Continuum (issue 28): when a named program's chat turn ends in tool calls, the program will be back
with the same context and the tools' results. Its context (prompt and output; llama.cpp caches the
output too, torch the prompt) is pinned in the engine's prefix cache for a TTL the engine sets from
the cost of filling it again (``PinPolicy.retention_ttl``), under the program's id; the program's
measured pauses predict when it is back, which ranks the entry's eviction should the pin end first.
A turn that does not end in tool calls unpins the program: it is not waiting on anything the route
can see. A ``cache_control`` mark pins the prompt up to and including its message for the mark's TTL.

Pins are best effort: an engine without them, or one that refuses (its budget full), serves the
request the same; a pin never fails a request. The pin waits for one engine iteration, and only on
those turns: the client's tool runs meanwhile anyway.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from headrace.batching.programs import ProgramRegistry
from headrace.daemon import structured
from headrace.daemon.openai_schemas import ChatCompletionRequest, cache_ttl_seconds
from headrace.graph.collector import ChoiceDelta
from headrace.plugins.engines.kvreuse.prefix_cache import common_prefix
from headrace.plugins.protocols import PinsPrefixes

log = logging.getLogger(__name__)


def marks(body: ChatCompletionRequest) -> list[tuple[int, float]]:
    """(message index, TTL seconds) of each message that carries a ``cache_control`` mark, on itself or a part."""
    out = []
    for i, m in enumerate(body.messages):
        found = [m.cache_control] if m.cache_control is not None else []
        if isinstance(m.content, list):
            found += [p.cache_control for p in m.content if p.cache_control is not None]
        if found:
            out.append((i, max(cache_ttl_seconds(c.ttl) for c in found)))
    return out


def marked_prefixes(engine: Any, messages: list[dict[str, Any]], tools: structured.ToolPlan | None,
                    tokens: list[int], marked: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(tokens of the prompt up to and including the marked message, TTL) for each mark: where the prompt and
    the conversation cut after that message render alike."""
    out = []
    for i, ttl in marked:
        cut = messages[: i + 1]
        prefix = engine.chat_tokens(cut, tools.specs) if tools is not None else engine.chat_tokens(cut)
        out.append((common_prefix(tokens, prefix), ttl))
    return out


@dataclass
class Turn:
    """What one chat request's choices generated, for the pins after it."""

    tools: structured.ToolPlan | None
    text: dict[int, list[str]] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)

    def tool_call_ids(self) -> list[int] | None:
        """The tokens of the first choice that ended in tool calls; None: none did."""
        if self.tools is None:
            return None
        for index in sorted(self.ids):
            if self.finish.get(index) == "stop" and structured.parse_tool_output(
                    "".join(self.text[index]), self.tools.names)[1]:
                return self.ids[index]
        return None


async def pinned_after(deltas: AsyncIterator[ChoiceDelta], engine: Any, prompt: list[int],
                       tools: structured.ToolPlan | None, program: str | None, registry: ProgramRegistry,
                       prefixes: list[tuple[int, float]], partition: str = "") -> AsyncIterator[ChoiceDelta]:
    """``deltas``; once they all came (not when the client left), the turn's pins, in the request's cache
    ``partition`` (where its prompt was cached)."""
    turn = Turn(tools)
    async with aclosing(deltas):  # closed early (the client left), the run below is cancelled
        async for c in deltas:
            turn.text.setdefault(c.index, []).append(c.delta.text)
            turn.ids.setdefault(c.index, []).extend(c.delta.token_ids)
            turn.finish[c.index] = c.delta.finish_reason or turn.finish.get(c.index)
            yield c
    if not isinstance(engine, PinsPrefixes):
        return
    # The shared partition: the call every engine has always taken.
    where = {"cache_partition": partition} if partition and getattr(engine, "isolates_caches", False) else {}
    for n, ttl in prefixes:
        await _best_effort(lambda n=n, ttl=ttl: engine.pin_prefix(prompt[:n], ttl, **where))
    if program is None:
        return
    generated = turn.tool_call_ids()
    if generated is not None:
        next_use = registry.wait_on_tool(program)
        # Refused for the budget, the entry still carries the program's predicted return: unpinned later all the same.
        if await _best_effort(lambda: engine.pin_prefix(prompt + generated, None, owner=program,
                                                        next_use=next_use, **where)) is not None:
            registry.retained.add(program)
    elif program in registry.retained:
        registry.retained.discard(program)
        await _best_effort(lambda: engine.unpin_prefix(program))


async def _best_effort(call: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await call()
    except Exception as exc:  # the engine stopped or unloaded: the answer stands without its pin
        log.info("a prefix-cache pin was not made: %s", exc)
        return None
