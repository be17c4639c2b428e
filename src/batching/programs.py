"""Programs across OpenAI requests: which program a request joins, and the service it has attained.

Autellix (program-level least attained service, PLAS) ranks an LLM call by the service its
program was served so far. A workflow run is a program (``PrimitiveMeta.run``); a plain
OpenAI request is a run of one call unless it names a program, which it does (in this order,
the first given wins):

1. ``prompt_cache_key``: OpenAI's own field for requests that share a prefix (an agent's or a
   conversation's turns), so the field an SDK already sets for caching;
2. ``user``: OpenAI's end-user id, the fallback (all of one user's requests are one program);
3. the ``X-Headrace-Program`` header, for clients that can set neither body field.

The three are kept apart (``key:``, ``user:``, ``header:`` prefixes) and per API key, so one
client's ``user`` never adds to another's program. ``ProgramRegistry`` keeps each named
program's attained service (the tokens the engine computed for its finished requests: prompt tokens
less its prefix-cache hits, plus generated ones), bounded in
size and forgotten after an idle time: a program that stops calling starts again at zero.

It also times each program's pauses on a tool (from a turn that ended in tool calls to the
program's next request): their mean predicts when a waiting program is back, which ranks its
retained KV in the prefix cache's eviction (KVFlow's steps-to-next-use, in seconds here).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Callable

PROGRAM_HEADER = "x-headrace-program"
MAX_PROGRAM_ID = 512  # characters of a named program id kept as given (longer: its digest)


def program_of(prompt_cache_key: str | None, user: str | None, header: str | None,
               principal: str | None = None) -> str | None:
    """The program a request names (see the module's precedence), or None: a program of one call.
    An empty value names nothing; a value longer than ``MAX_PROGRAM_ID`` is kept as its digest."""
    for source, value in (("key", prompt_cache_key), ("user", user), ("header", header)):
        if value:
            if len(value) > MAX_PROGRAM_ID:
                value = "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
            return f"{source}:{value}" if principal is None else f"{principal}/{source}:{value}"
    return None


class ProgramRegistry:
    """Attained service (tokens) per named program: at most ``capacity`` programs, the least recently
    active dropped first, and a program idle for ``idle_seconds`` forgotten."""

    def __init__(self, capacity: int = 4096, idle_seconds: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or idle_seconds <= 0:
            raise ValueError("a program registry needs capacity >= 1 and idle_seconds > 0")
        self.capacity, self.idle_seconds, self._clock = capacity, idle_seconds, clock
        self._programs: OrderedDict[str, tuple[int, float]] = OrderedDict()  # id -> (tokens, last active)
        self._waiting: dict[str, float] = {}  # program -> when its turn ended in tool calls
        self._tool_seconds: dict[str, float] = {}  # program -> its mean pause on a tool so far
        self.retained: set[str] = set()  # programs holding a pin in an engine's prefix cache (the routes keep it)

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._programs)

    def attained(self, program: str | None) -> int:
        """The tokens ``program``'s earlier requests were served (0: unknown, expired or None). A request
        starting counts as activity: the program's idle time starts again."""
        if program is None:
            return 0
        now = self._clock()
        self._expire(now)
        entry = self._programs.get(program)
        if entry is None:
            return 0
        self._programs[program] = (entry[0], now)
        self._programs.move_to_end(program)
        return entry[0]

    def add(self, program: str | None, tokens: int) -> int:
        """Count ``tokens`` (a finished request's computed prompt tokens + generated) to ``program``; its new total."""
        if program is None:
            return 0
        now = self._clock()
        self._expire(now)
        total = self._programs.pop(program, (0, now))[0] + max(0, tokens)
        self._programs[program] = (total, now)
        while len(self._programs) > self.capacity:
            self._programs.popitem(last=False)
        return total

    def wait_on_tool(self, program: str) -> float | None:
        """``program``'s turn ended in tool calls: its pause starts. The seconds it is predicted to last (its
        mean pause so far; None: its first)."""
        self._waiting[program] = self._clock()
        return self._tool_seconds.get(program)

    def back(self, program: str | None) -> None:
        """``program``'s next request came: a pause on a tool, if one was open, is measured."""
        since = self._waiting.pop(program, None) if program is not None else None
        if since is not None:
            took = self._clock() - since
            mean = self._tool_seconds.get(program)  # type: ignore[arg-type]
            self._tool_seconds[program] = took if mean is None else 0.5 * (mean + took)  # type: ignore[index]

    def _expire(self, now: float) -> None:
        while self._programs:
            program, (_, last) = next(iter(self._programs.items()))
            if now - last < self.idle_seconds:
                break
            del self._programs[program]
        for table in (self._waiting, self._tool_seconds):
            if len(table) > len(self._programs):  # some belong to forgotten programs (a scan only then)
                for program in [p for p in table if p not in self._programs]:
                    del table[program]
