"""The critical-path bound of a workflow run: its e-graph's longest path at isolated compute times.

Input: the run's graph (``GET /v1/runs/{id}/graph``) and the timeline of a run of
it made with ``config.isolate`` (``GET /v1/runs/{id}/timeline``), where the
executor let one engine compute at a time (primitives ready together on that
engine still batch), so each node instance's duration is its batched compute
time with nothing else competing. The bound schedules every node instance as
early as its dependencies allow, with unlimited parallelism, so latency / bound
says how far the scheduler is from ideal. ``engine_bound`` adds the other lower
bound: the busiest engine's total compute, which no schedule can overlap away.

Node instances are matched by scope keys. An instance depends on each parent
node's instances whose key is a prefix of its own (an outer scope, or the same
scope) or extends it (an aggregate waits for every piece of its region). A
region's source counts only its own primitive (``op_end``), not its region. A
member of a streamed region depends not on its source decode's end but on the
moment the source parsed that piece, at the same offset from the decode's start
as in the isolated run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class Step:
    node: str
    key: tuple
    op: str
    engine: str | None
    start: float  # when the bound schedule starts it
    seconds: float  # its isolated duration


@dataclass
class CriticalPath:
    seconds: float  # the bound: when the last instance ends
    path: list[Step] = field(default_factory=list)  # the chain of instances that sets it, first to last
    compute_seconds: float = 0.0  # every instance's isolated time, summed (the fully serial time)

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "compute_seconds": self.compute_seconds,
                "path": [{"node": s.node, "key": list(s.key), "op": s.op, "engine": s.engine,
                          "start": round(s.start, 6), "seconds": round(s.seconds, 6)} for s in self.path]}


def critical_path(graph: dict[str, Any], nodes: Iterable[dict[str, Any]]) -> CriticalPath:
    """The bound for ``graph`` (its JSON form) from an isolated run's node records."""
    parents: dict[str, set[str]] = {}
    for edge in graph["edges"]:
        parents.setdefault(edge["dst"], set()).add(edge["src"])
    region = {n["id"]: n.get("region") for n in graph["nodes"]}
    records = [r for r in nodes if r.get("start") is not None and r.get("end") is not None]
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_node.setdefault(r["node"], []).append(r)
    for node in parents:
        if node not in region:
            raise ValueError(f"edge into {node!r}, which is not a node of the graph")

    finish: dict[int, float] = {}  # id(record) -> bound end
    start: dict[int, float] = {}
    via: dict[int, dict[str, Any] | None] = {}  # the dependency that made it wait longest

    def end_of(r: dict[str, Any]) -> float:
        rid = id(r)
        if rid in finish:
            return finish[rid]
        finish[rid] = float("inf")  # marks "in progress": a cycle would be a malformed timeline
        key = tuple(r["key"])
        ready, why = 0.0, None
        for p in parents.get(r["node"], ()):
            for dep in by_node.get(p, ()):
                dkey = tuple(dep["key"])
                if not (_prefix(dkey, key) or _prefix(key, dkey)):
                    continue
                t = _ready_after(dep, dkey, key, region.get(r["node"]) == p, end_of)
                if t == float("inf"):
                    raise ValueError(f"the timeline has a cycle through {r['node']!r}")
                if t > ready:
                    ready, why = t, dep
        start[rid], via[rid] = ready, why
        finish[rid] = ready + _seconds(r)
        return finish[rid]

    if not records:
        return CriticalPath(0.0)
    last = max(records, key=end_of)
    path, r = [], last
    while r is not None:
        path.append(Step(r["node"], tuple(r["key"]), r.get("op", ""), r.get("engine"), start[id(r)], _seconds(r)))
        r = via[id(r)]
    return CriticalPath(finish[id(last)], path[::-1], sum(_seconds(r) for r in records))


def _ready_after(dep: dict[str, Any], dkey: tuple, key: tuple, streamed_member: bool, end_of) -> float:
    """When ``dep`` lets the instance at ``key`` start."""
    pieces = dep.get("pieces") or []
    if streamed_member and len(key) > len(dkey) and pieces:
        index = key[len(dkey)]
        if index < len(pieces):  # the piece's offset into the decode, measured in the isolated run
            bound_start = end_of(dep) - _seconds(dep)
            return bound_start + max(0.0, pieces[index] - dep["start"])
    return end_of(dep)


def engine_bound(timeline: dict[str, Any]) -> tuple[str | None, float]:
    """(engine, seconds): the engine that computed longest in the run, counting overlapping batches once."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for b in timeline["engines"]:
        spans.setdefault(b["engine"], []).append((b["start"], b["end"]))
    best: tuple[str | None, float] = (None, 0.0)
    for engine, intervals in spans.items():
        total, reach = 0.0, float("-inf")
        for s, e in sorted(intervals):
            if e > reach:
                total += e - max(s, reach)
                reach = e
        if total > best[1]:
            best = (engine, total)
    return best


def _prefix(short: tuple, long: tuple) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def _seconds(r: dict[str, Any]) -> float:
    """The instance's own time: a region's source ends with its primitive, not with its region."""
    end = r.get("op_end") if r.get("op_end") is not None else r["end"]
    return max(0.0, end - r["start"])
