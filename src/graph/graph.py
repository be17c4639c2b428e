"""The primitive graph: nodes (primitives with scheduler metadata) and edges.

A p-graph comes out of a workflow's expansion; the passes rewrite it into the
e-graph that the executor runs. Edges carry the variable that flows along them
(``var``), or none for an order-only edge inherited from ``>>``; a ``stream``
edge carries pieces of a partial decode.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable

# An LLM primitive's output length when nothing sets one: a template component with no max_tokens in
# its config, a traced call, a semantic call's output. (A workflow's own max_tokens option has its
# own default, and OpenAI requests theirs: DEFAULT_MAX_TOKENS, COMPLETIONS_MAX_TOKENS.)
LLM_MAX_TOKENS = 128


class Op(StrEnum):
    PREFILL = "prefill"
    PARTIAL_PREFILL = "partial_prefill"
    FULL_PREFILL = "full_prefill"
    DECODE = "decode"
    PARTIAL_DECODE = "partial_decode"
    EMBED = "embed"
    INGEST = "ingest"
    SEARCH = "search"
    TEXT_SEARCH = "text_search"
    RERANK = "rerank"
    CHUNK = "chunk"
    CONDITION = "condition"
    AGGREGATE = "aggregate"
    FUNCTION = "function"


BATCHABLE_OPS = {Op.EMBED, Op.SEARCH, Op.TEXT_SEARCH, Op.RERANK, Op.INGEST}


@dataclass
class Node:
    id: str
    op: Op
    engine: str | None = None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    component: str = ""
    batchable: bool = False
    splittable: str | None = None  # how the output divides: "lines" or "json"
    # Scheduler metadata.
    depth: int = 0
    size: int = 1  # items for a batchable primitive, tokens for an LLM one
    prefix_hash: str | None = None
    # Set by decode pipelining: the stream source whose pieces this node runs once per.
    region: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["op"] = str(self.op)
        out["params"] = {k: v for k, v in self.params.items() if _jsonable(v)}
        return out


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    var: str | None = None  # None: an order-only edge
    stream: bool = False


class Graph:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self.nodes: dict[str, Node] = {}
        self.edges: set[Edge] = set()
        self.branches: dict[str, dict[str, list[str]]] = {}  # condition id -> branch label -> node ids

    # building -------------------------------------------------------------------

    def add(self, node: Node) -> Node:
        if node.id in self.nodes:
            raise ValueError(f"duplicate node id {node.id!r}")
        self.nodes[node.id] = node
        return node

    def connect(self, src: str, dst: str, var: str | None = None, stream: bool = False) -> None:
        for end in (src, dst):
            if end not in self.nodes:
                raise KeyError(f"no node {end!r}")
        self.edges.add(Edge(src, dst, var, stream))

    def rewire(self) -> None:
        """Rebuild the data edges from the nodes' inputs and outputs, keeping order-only edges.

        An edge into a node of a streamed region from the region's source is a stream edge.
        """
        order = {e for e in self.edges if e.var is None and e.src in self.nodes and e.dst in self.nodes}
        self.edges = order
        producers: dict[str, str] = {}
        for node in self.nodes.values():
            for var in node.outputs:
                producers[var] = node.id
        for node in self.nodes.values():
            for var in (*node.inputs, *node.params.get("reads", ())):
                src = producers.get(var)
                if src is not None and src != node.id:
                    self.edges.add(Edge(src, node.id, var, stream=node.region == src))

    def remove(self, node_id: str) -> None:
        del self.nodes[node_id]
        self.edges = {e for e in self.edges if node_id not in (e.src, e.dst)}

    def copy(self) -> Graph:
        return copy.deepcopy(self)

    # queries --------------------------------------------------------------------

    def in_edges(self, node_id: str) -> list[Edge]:
        return sorted((e for e in self.edges if e.dst == node_id), key=_edge_key)

    def out_edges(self, node_id: str) -> list[Edge]:
        return sorted((e for e in self.edges if e.src == node_id), key=_edge_key)

    def parents(self, node_id: str) -> list[str]:
        return sorted({e.src for e in self.in_edges(node_id)})

    def children(self, node_id: str) -> list[str]:
        return sorted({e.dst for e in self.out_edges(node_id)})

    def producer(self, var: str) -> str | None:
        for node in self.nodes.values():
            if var in node.outputs:
                return node.id
        return None

    def consumers(self, var: str) -> list[str]:
        return [n.id for n in self.nodes.values() if var in n.inputs]

    def topo_order(self) -> list[str]:
        indegree = {n: len(self.parents(n)) for n in self.nodes}
        ready = sorted(n for n, d in indegree.items() if d == 0)
        order = []
        while ready:
            n = ready.pop(0)
            order.append(n)
            for child in self.children(n):
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
        if len(order) != len(self.nodes):
            raise ValueError(f"graph {self.name!r} has a cycle")
        return order

    def compute_depths(self) -> None:
        """Ayo Algorithm 2, event 1: outputs have depth 0, a parent is one deeper than its deepest child."""
        for node in self.nodes.values():
            node.depth = 0
        for n in reversed(self.topo_order()):
            for p in self.parents(n):
                self.nodes[p].depth = max(self.nodes[p].depth, self.nodes[n].depth + 1)

    def descendants(self, node_id: str) -> set[str]:
        return self._reachable(node_id, self.children)

    def ancestors(self, node_id: str) -> set[str]:
        return self._reachable(node_id, self.parents)

    @staticmethod
    def _reachable(node_id: str, step: Callable[[str], Iterable[str]]) -> set[str]:
        seen: set[str] = set()
        stack = [node_id]
        while stack:
            for other in step(stack.pop()):
                if other not in seen:
                    seen.add(other)
                    stack.append(other)
        return seen

    # export ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes": [self.nodes[n].to_json() for n in self.topo_order()],
            "edges": [{"src": e.src, "dst": e.dst, "var": e.var, "stream": e.stream} for e in sorted(self.edges, key=_edge_key)],
            "branches": self.branches,
        }

    def to_dot(self) -> str:
        lines = [f"digraph {_dot_string(self.name or 'workflow')} {{", "  rankdir=LR;"]
        for n in self.topo_order():
            node = self.nodes[n]
            label = _dot_string(node.id, f"{node.op}" + (f" @{node.engine}" if node.engine else ""))
            shape = "diamond" if node.op == Op.CONDITION else "box"
            lines.append(f"  {_dot_string(n)} [label={label}, shape={shape}];")
        for e in sorted(self.edges, key=_edge_key):
            style = "dashed" if e.var is None else ("bold" if e.stream else "solid")
            lines.append(f"  {_dot_string(e.src)} -> {_dot_string(e.dst)} [label={_dot_string(e.var or '')}, style={style}];")
        lines.append("}")
        return "\n".join(lines)


def _dot_string(*lines: str) -> str:
    """A quoted DOT string (an id, or a label showing ``lines`` one under another).

    DOT's escapes, not JSON's: ``\\n`` inside a quoted string is a line break, so the lines are
    escaped one by one (backslash, quote) and joined with it. JSON quoting escaped that
    backslash too, and Graphviz printed a literal ``\\n``; it also wrote non-ASCII as ``\\uXXXX``.
    """
    return '"' + "\\n".join(line.replace("\\", "\\\\").replace('"', '\\"') for line in lines) + '"'


def _edge_key(e: Edge) -> tuple:
    return (e.src, e.dst, e.var or "", e.stream)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
