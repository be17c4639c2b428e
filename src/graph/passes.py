"""The four built-in optimization passes (Ayo §4.2), a plugin like any other.

Each pass rewrites the graph in place and returns what it changed (a list of
short descriptions, empty when nothing matched); the pass manager runs them to
a fixpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

from headrace.graph.graph import Graph, Node, Op
from headrace.graph.prompts import PromptTemplate
from headrace.graph.regions import map_over, region_of
from headrace.plugins.hookspecs import hookimpl

STREAMABLE = {Op.EMBED, Op.SEARCH, Op.TEXT_SEARCH}


@dataclass
class PassEnv:
    """What passes may know beyond the graph."""

    # Engine name -> its max efficient batch size (None: unknown, never split).
    max_efficient_batch: Callable[[str], int | None] = lambda engine: None
    inputs: set[str] = field(default_factory=set)  # the run's input variables, available at once


class GraphPass(Protocol):
    name: str

    def apply(self, graph: Graph, env: PassEnv) -> list[str]: ...


class PruneDependencies:
    """Pass 1: drop every edge not backed by a data dependency, so independent branches run in parallel."""

    name = "prune_dependencies"

    def apply(self, graph: Graph, env: PassEnv) -> list[str]:
        order = sorted((e for e in graph.edges if e.var is None), key=lambda e: (e.src, e.dst))
        graph.edges -= set(order)
        return [f"{e.src} -> {e.dst}" for e in order]


class StageDecomposition:
    """Pass 2: split an oversized batchable primitive into stages that pipeline into the next one.

    Ayo splits embeds, searches and reranks. An embed's stages feed the matching stages of the ingest
    or search that reads its vectors, so stage i of those starts as soon as stage i of the embed ends.
    A search or rerank larger than its own engine's limit splits on its own: every stage reads the
    whole input and takes its slice (``params["slice"]``) of the query vectors or the documents.
    """

    name = "stage_decomposition"

    def apply(self, graph: Graph, env: PassEnv) -> list[str]:
        changes = []
        for node in list(graph.nodes.values()):
            if node.id not in graph.nodes or node.op not in SPLITS or node.op == Op.INGEST:
                continue
            if node.region or "slice" in node.params or "stage" in node.params or not node.engine:
                continue
            limit = env.max_efficient_batch(node.engine)
            if not limit or node.size <= limit:
                continue
            stages = math.ceil(node.size / limit)
            slices = [(i * limit, min(node.size, (i + 1) * limit)) for i in range(stages)]
            out = node.outputs[0]
            consumers = [graph.nodes[c] for c in graph.consumers(out)]
            self._split(graph, node, slices, piped=None)
            changes.append(f"{node.id}: {stages} stages of <= {limit}")
            if node.op != Op.EMBED:
                continue
            for consumer in consumers:
                if consumer.op in (Op.INGEST, Op.SEARCH) and consumer.inputs[0] == out and not consumer.region \
                        and "slice" not in consumer.params and "stage" not in consumer.params:
                    self._split(graph, consumer, slices, piped=out)
                    changes.append(f"{consumer.id}: {stages} stages pipelined after {node.id}")
        graph.rewire()
        return changes

    @staticmethod
    def _split(graph: Graph, node: Node, slices: list[tuple[int, int]], piped: str | None) -> None:
        """Replace ``node`` by one stage per slice and an aggregate that restores its output.

        ``piped``: the variable split by an upstream embed; stage i then reads that embed's stage i
        instead of slicing the whole of it.
        """
        # Only pruning drops order-only edges: the stages keep the node's predecessors, its successors
        # wait for the aggregate.
        order_in = [e.src for e in graph.in_edges(node.id) if e.var is None]
        order_out = [e.dst for e in graph.out_edges(node.id) if e.var is None]
        graph.remove(node.id)
        parts = []
        for i, (start, end) in enumerate(slices):
            inputs = tuple(f"{v}#{i}" if v == piped else v for v in node.inputs)
            params = {**node.params, "stage": i}
            # An ingest's vectors arrive sliced, its texts are sliced here; a search fed by an embed
            # stage searches all the vectors it gets.
            if not (piped is not None and node.op == Op.SEARCH):
                params["slice"] = (start, end)
            stage = Node(
                id=f"{node.id}#{i}", op=node.op, engine=node.engine, inputs=inputs,
                outputs=tuple(f"{v}#{i}" for v in node.outputs), params=params, component=node.component,
                batchable=True, size=end - start,
            )
            graph.add(stage)
            parts.append(stage.outputs[0])
            for src in order_in:
                graph.connect(src, stage.id)
        agg = graph.add(Node(id=f"{node.id}.agg", op=Op.AGGREGATE, inputs=tuple(parts), outputs=node.outputs[:1],
                             params=SPLITS[node.op](node), component=node.component))
        for dst in order_out:
            graph.connect(agg.id, dst)


# How each splittable op's stages are put back together (the aggregate's params).
SPLITS: dict[Op, Callable[[Node], dict]] = {
    Op.EMBED: lambda node: {"op": "concat"},  # the vectors, rows in order
    Op.INGEST: lambda node: {"op": "last"},  # the collection's name, once every stage has written
    Op.SEARCH: lambda node: {"op": "concat", "dedupe": True},  # the hits, in query order
    # Each rerank stage scores its documents; the best top_n over all stages, scores dropped.
    Op.RERANK: lambda node: {"op": "topk", "k": node.params.get("top_n", 3), "values": True},
}


class PrefillSplit:
    """Pass 3: prefill the part of a prompt that is ready before its inputs, in parallel with upstream work."""

    name = "prefill_split"
    MIN_CHARS = 16  # a shorter prefix is not worth a context of its own

    def apply(self, graph: Graph, env: PassEnv) -> list[str]:
        changes = []
        for node in list(graph.nodes.values()):
            if node.op != Op.PREFILL:
                continue
            template = PromptTemplate(node.params["prompt"])
            prefix, rest = template.split(env.inputs)
            if len(prefix.strip()) < self.MIN_CHARS or not PromptTemplate(rest).inputs:
                continue
            head = Node(
                id=f"{node.id}.partial", op=Op.PARTIAL_PREFILL, engine=node.engine,
                inputs=PromptTemplate(prefix).inputs, outputs=(f"{node.id}.partial.ctx",),
                params={**node.params, "prompt": prefix}, component=node.component,
                # Its inputs are the run's own, so it runs once, at the top: every
                # per-item full prefill forks the one shared prefix (Parrot's context fork).
                size=len(prefix), prefix_hash=template.prefix_hash(), region=None,
            )
            graph.add(head)
            node.op = Op.FULL_PREFILL
            # The prefix and what it reads stay with the rest: should the early prefill not run (its
            # engine busy with other runs), this prefill fills the whole prompt itself.
            node.params = {**node.params, "prompt": rest, "parent": head.outputs[0], "split_prefix": prefix,
                           "reads": (*node.params.get("reads", ()), *head.inputs)}
            node.inputs = (*PromptTemplate(rest).inputs, head.outputs[0])
            changes.append(f"{node.id}: prefix of {len(prefix)} chars prefilled early as {head.id}")
        if changes:
            graph.rewire()
        return changes


class DecodePipelining:
    """Pass 4: a splittable decode streams each parsed piece to its batchable consumers at once.

    The region that runs once per piece holds what the workflow already maps over
    the decode's items (an LLM component applied per claim, say), plus the
    decode's embed and search consumers and the embeds and searches they feed. The
    decode becomes a partial decode: the region starts on the first piece, not
    after the last. A splittable decode inside a region becomes a nested region
    on a later round: ALTO's claim -> query -> search fan-out.
    """

    name = "decode_pipelining"

    def apply(self, graph: Graph, env: PassEnv) -> list[str]:
        changes = []
        for node in list(graph.nodes.values()):
            if node.op != Op.DECODE or not node.splittable:
                continue
            piece = node.outputs[0]
            region = region_of(graph, node.id)
            region |= {c for c in graph.consumers(piece) if self._joins(graph.nodes[c], node)}
            if not region:
                continue
            self._grow(graph, node, region)
            node.op = Op.PARTIAL_DECODE
            members = map_over(graph, node, region)
            changes.append(f"{node.id}: streams {node.splittable} pieces into {', '.join(members)}")
        return changes

    @staticmethod
    def _joins(candidate: Node, source: Node) -> bool:
        """A primitive that gives the same result per piece as over the whole list, in the source's scope.

        Embeds and searches are: they treat list items independently. An LLM call over a list is
        not (it sees the items together), so only the workflow's own ``map`` makes one per-item.
        """
        return candidate.region == source.region and candidate.op in STREAMABLE

    @classmethod
    def _grow(cls, graph: Graph, source: Node, region: set[str]) -> None:
        """Extend the region through primitives fed by it, whose other inputs do not wait on the source."""
        downstream = graph.descendants(source.id)
        grew = True
        while grew:
            grew = False
            produced = {v for n in region for v in graph.nodes[n].outputs}
            for n in graph.nodes.values():
                if n.id in region or n.region != source.region:
                    continue
                fed = [v for v in n.inputs if v in produced]
                if not fed or not cls._joins(n, source):
                    continue
                others = [graph.producer(v) for v in n.inputs if v not in produced and v != source.outputs[0]]
                if all(p is None or p not in downstream for p in others):
                    region.add(n.id)
                    grew = True


BUILTIN_PASSES = (PruneDependencies, StageDecomposition, PrefillSplit, DecodePipelining)


@hookimpl
def register_passes(register):
    for cls in BUILTIN_PASSES:
        register(cls.name, cls())
