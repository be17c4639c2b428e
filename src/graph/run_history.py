"""The finished runs kept for ``GET /v1/runs``: bounded by count and by bytes, the older ones packed.

Each finished run is measured once, when it ends. The newest ``LIVE_FINISHED`` finished runs keep
their objects (an in-process caller reads ``run.graph`` and ``run.records`` of the run it just got
back). Older ones are packed: what the routes serve of them (graph, DOT, node timeline, passes) is
kept as compressed JSON and the objects go, a few KiB a run where they held tens. Their inputs,
which no route serves, go with them. Past the byte budget the oldest finished runs lose their
details (graph, passes, per-piece timings): each keeps its summary (id, workflow, status, owner,
result or error, seconds, node timeline) and says ``details_dropped``. If the summaries alone
exceed the budget, the oldest runs go whole. A run that has not finished is never measured,
packed, dropped or evicted.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections import OrderedDict, deque
from enum import Enum
from typing import Any

from headrace.graph.events import RunEvents
from headrace.graph.executor import Run
from headrace.graph.graph import Graph

RUN_HISTORY_BYTES = 64 * 2**20
LIVE_FINISHED = 32  # the newest finished runs that keep their objects; older ones are packed
_CONTAINERS = (list, tuple, set, frozenset, deque)


def retained_bytes(*parts: Any) -> int:
    """The memory ``parts`` hold: ``sys.getsizeof`` over every object reachable through containers and
    headrace's own objects, each object counted once.

    Why this and not the JSON size: it counts what memory holds (object headers, dict tables, a
    document shared by the inputs and a graph node once), where JSON text undercounts small objects
    several times over and counts a shared document twice. Only plain data is followed: a function, a
    bound method or a foreign object (an anyio event) is counted alone, so the walk never wanders from
    the run into the service or the engines.
    """
    seen: set[int] = set()
    total = 0
    pending = list(parts)
    while pending:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            pending.extend(obj.keys())
            pending.extend(obj.values())
        elif isinstance(obj, _CONTAINERS):
            pending.extend(obj)
        elif type(obj).__module__.startswith("headrace.") and not isinstance(obj, (type, Enum)):
            if hasattr(obj, "__dict__"):
                pending.append(vars(obj))
            for slot in getattr(type(obj), "__slots__", ()):
                pending.append(getattr(obj, slot, None))
    return total


def timeline(run: Run) -> list[dict[str, Any]]:
    """Each node's record, in seconds from the run's start (a packed run's, as it was packed)."""
    packed = _unpacked(run)
    if packed is not None:
        return packed["nodes"]
    return [r.to_json(run.started) for r in run.records]


def passes(run: Run) -> list[dict[str, Any]]:
    """What each rewrite pass changed in the run's graph."""
    packed = _unpacked(run)
    if packed is not None:
        return packed.get("passes", [])
    return [{"pass": name, "changes": changes} for name, changes in run.applied]


def timeline_and_passes(run: Run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``timeline(run)`` and ``passes(run)`` with one decompression: a run's record shows both."""
    packed = _unpacked(run)
    if packed is not None:
        return packed["nodes"], packed.get("passes", [])
    return timeline(run), passes(run)


def graph_and_dot(run: Run) -> tuple[dict[str, Any], str]:
    """The run's graph as JSON and as DOT; KeyError for a run whose details were dropped."""
    packed = _unpacked(run)
    if packed is not None:
        return packed["graph"], packed["dot"]
    return run.graph.to_json(), run.graph.to_dot()


def pack(run: Run) -> None:
    """Keep what the routes serve of a finished run as compressed JSON; let its objects go.

    zlib over JSON: the standard library's, and a run's text (prompts, documents in node params)
    compresses several times over; a read decompresses a few KiB.
    """
    if run.packed is not None:
        return
    graph, dot = graph_and_dot(run)
    _set_packed(run, {"nodes": timeline(run), "passes": passes(run), "graph": graph, "dot": dot})


def drop_details(run: Run) -> None:
    """Keep the run's summary and timeline; let the rest go (the graph and events routes answer 410)."""
    nodes = [{**node, "pieces": []} for node in timeline(run)]
    _set_packed(run, {"nodes": nodes})
    run.events = RunEvents(1)  # a reader that still follows the old log keeps it until it leaves
    run.events.close()
    run.details_dropped = True


def _set_packed(run: Run, kept: dict[str, Any]) -> None:
    run.packed = zlib.compress(json.dumps(kept, separators=(",", ":")).encode())
    run.inputs = {}
    run.graph = Graph(run.graph.name)
    run.records = []
    run.applied = []
    run.growth = None
    run.on_delta = None


def _unpacked(run: Run) -> dict[str, Any] | None:
    return None if run.packed is None else json.loads(zlib.decompress(run.packed))


class RunHistory:
    """Keeps ``runs`` (the service's id -> run, oldest first) within ``keep_runs`` runs and ``budget_bytes``."""

    def __init__(self, runs: OrderedDict[str, Run], keep_runs: int, budget_bytes: int = RUN_HISTORY_BYTES,
                 live_finished: int = LIVE_FINISHED) -> None:
        self.runs = runs
        self.keep_runs = keep_runs
        self.budget_bytes = budget_bytes
        self.live_finished = live_finished
        self._live: deque[str] = deque()  # finished runs not packed yet, oldest first
        # Finished runs' measured sizes, oldest finished first: those still holding details, and those not.
        self._detailed: OrderedDict[str, int] = OrderedDict()
        self._summaries: OrderedDict[str, int] = OrderedDict()
        self.total_bytes = 0  # what the finished runs kept hold, as measured

    def add(self, run: Run) -> None:
        """A new run; past ``keep_runs`` the oldest go, up to the first still running."""
        self.runs[run.id] = run
        while len(self.runs) > self.keep_runs:
            old_id, old = next(iter(self.runs.items()))
            if old.status == "running":
                break
            self._forget(old_id)

    def finished(self, run: Run) -> None:
        """Measure the run that just ended, then bring the history back within its budget."""
        if run.id not in self.runs or run.id in self._detailed or run.id in self._summaries:
            return  # evicted already (by count), or counted already
        size = retained_bytes(run)  # all it holds: inputs, result, graph, events, records, ...
        self._detailed[run.id] = size
        self.total_bytes += size
        self._live.append(run.id)
        while len(self._live) > self.live_finished:
            self._pack(self._live.popleft())
        self._enforce_budget()

    def _pack(self, run_id: str) -> None:
        if run_id not in self._detailed:
            return  # gone, or its details dropped, since it finished
        run = self.runs[run_id]
        pack(run)
        size = retained_bytes(run)
        self.total_bytes += size - self._detailed[run_id]
        self._detailed[run_id] = size

    def _enforce_budget(self) -> None:
        while self.total_bytes > self.budget_bytes and self._detailed:
            run_id, size = self._detailed.popitem(last=False)
            run = self.runs[run_id]
            drop_details(run)
            kept = retained_bytes(run)
            self._summaries[run_id] = kept
            self.total_bytes += kept - size
        while self.total_bytes > self.budget_bytes and self._summaries:
            self._forget(next(iter(self._summaries)))

    def usage(self) -> tuple[int, int, int]:
        """(bytes the finished runs hold as measured, runs with their details, runs kept as summaries): a bounded
        cache that fills over the first ``keep_runs`` runs, so /metrics says how full it is."""
        return self.total_bytes, len(self._detailed), len(self._summaries)

    def _forget(self, run_id: str) -> None:
        del self.runs[run_id]
        self.total_bytes -= self._detailed.pop(run_id, 0) + self._summaries.pop(run_id, 0)
