"""What the schedulers should optimise each primitive for, deduced from the graph (Parrot §5.2).

Two pure functions on an e-graph:

- ``objectives``: the calls that produce the run's outputs, and the calls right
  before them, are latency-critical; every other primitive only has to keep its
  stage's throughput up, since the run waits on the whole stage anyway.
- ``task_groups``: the parallel primitives of one stage (the maps of
  ``map_reduce_summary``, a region's per-piece instances) share a group, which a
  scheduler serves together so the stage finishes as one.

A "call" is an LLM request as Parrot sees it: a decode together with the
prefills that fill its context. Steps with no engine (functions, aggregates,
conditions) are not requests; the deduction looks through them.
"""

from __future__ import annotations

from typing import Iterable

from headrace.batching.meta import Objective
from headrace.graph.graph import Graph, Op

PREFILL_OPS = {Op.PREFILL, Op.PARTIAL_PREFILL, Op.FULL_PREFILL}
CONTEXT_READERS = {Op.DECODE, Op.PARTIAL_DECODE, Op.FULL_PREFILL}  # they continue a context a prefill filled


def objectives(graph: Graph, outputs: Iterable[str] = ()) -> dict[str, Objective]:
    """Each node's objective. ``outputs`` are the run's output variables; none: the graph's sinks."""
    producers = {p for p in (graph.producer(var) for var in outputs) if p is not None}
    ends = producers or {n for n in graph.nodes if not graph.children(n)}
    final = _whole_calls(graph, _nearest_requests(graph, ends))
    before = _nearest_requests(graph, {p for n in final for p in graph.parents(n)} - final)
    critical = final | _whole_calls(graph, before)
    return {n: "latency" if n in critical else "throughput" for n in graph.nodes}


def awaited_objectives(graph: Graph, latency: Iterable[str], throughput: Iterable[str]) -> dict[str, Objective]:
    """Each node's objective from how a client awaits variables (a session's ``criteria``, Parrot §5.2).

    Variables awaited for latency are the outputs ``objectives`` deduces from. With none, the
    graph's sinks are (as for a template run), except that every primitive a variable awaited
    for throughput depends on, directly or not, is throughput-preferred.
    """
    latency = [v for v in latency if graph.producer(v) is not None]
    if latency:
        return objectives(graph, latency)
    deduced = objectives(graph)
    for var in throughput:
        producer = graph.producer(var)
        if producer is not None:
            for node in graph.ancestors(producer) | {producer}:
                deduced[node] = "throughput"
    return deduced


def task_groups(graph: Graph) -> dict[str, str]:
    """The task group of each engine primitive that has one.

    A stage is the primitives of one component doing one op at one depth, in one
    region: at one depth none of them waits on another, so they run in parallel.
    It is a task group when it has two or more members, or runs once per piece of
    a streamed region (its instances are the parallel requests). Ids are unique
    within the graph.
    """
    stages: dict[tuple, list[str]] = {}
    for node in graph.nodes.values():
        if node.engine is None:
            continue
        stage = (node.region or "", node.component or node.id, str(node.op), node.depth)
        stages.setdefault(stage, []).append(node.id)
    groups = {}
    for (region, component, op, depth), members in stages.items():
        if len(members) > 1 or region:
            group = f"{region + '/' if region else ''}{component}.{op}@{depth}"
            groups.update(dict.fromkeys(members, group))
    return groups


def _nearest_requests(graph: Graph, start: set[str]) -> set[str]:
    """``start``'s engine primitives, and in place of each engine-less node the nearest ones above it."""
    found: set[str] = set()
    seen: set[str] = set()
    stack = list(start)
    while stack:
        node_id = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        if graph.nodes[node_id].engine is not None:
            found.add(node_id)
        else:
            stack.extend(graph.parents(node_id))
    return found


def _whole_calls(graph: Graph, nodes: set[str]) -> set[str]:
    """``nodes`` with the prefills whose contexts they continue (a decode's call, whole)."""
    calls = set(nodes)
    stack = list(nodes)
    while stack:
        node = graph.nodes[stack.pop()]
        if node.op not in CONTEXT_READERS:
            continue
        for parent in graph.parents(node.id):
            if graph.nodes[parent].op in PREFILL_OPS and parent not in calls:
                calls.add(parent)
                stack.append(parent)
    return calls
