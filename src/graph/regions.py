"""Regions: primitives that run once per item of a source's list output (ALTO's streaming fan-out).

The decode-pipelining pass makes them, and so does a workflow's own ``map``; the
executor runs a region's members per piece and its aggregates restore what leaves it.
"""

from __future__ import annotations

from headrace.graph.graph import Graph, Node, Op


def region_of(graph: Graph, source: str) -> set[str]:
    return {n for n, node in graph.nodes.items() if node.region == source}


def map_over(graph: Graph, source: Node, members: set[str]) -> list[str]:
    """Make ``members`` run once per item of ``source``'s list output; aggregates restore what leaves.

    Inside the region each member sees one item under the source's output name;
    a value that leaves the region is renamed ``<var>.piece`` there and an
    aggregate (concat, in item order) gives the rest of the graph ``<var>``.
    """
    for n in members:
        graph.nodes[n].region = source.id
    if f"{source.id}.pieces" not in source.outputs:
        source.outputs = (*source.outputs, f"{source.id}.pieces")
    region = region_of(graph, source.id)
    # The executor orders a region's primitives only among themselves: what the template put after one
    # of them waits for the source instead, which finishes after the region's last instance.
    for e in [e for e in graph.edges if e.var is None and e.src in region and e.dst not in region]:
        graph.edges.discard(e)
        if e.dst != source.id:
            graph.connect(source.id, e.dst)
    exits = []
    for n in sorted(region):
        for var in graph.nodes[n].outputs:
            if not var.endswith(".piece") and any(c not in region for c in graph.consumers(var)):
                exits.append((n, var))
    for producer, var in exits:
        local = f"{var}.piece"
        for n in region:
            node = graph.nodes[n]
            node.outputs = tuple(local if v == var else v for v in node.outputs)
            node.inputs = tuple(local if v == var else v for v in node.inputs)
        retrieval = graph.nodes[producer].op in (Op.SEARCH, Op.TEXT_SEARCH)
        graph.add(Node(
            id=f"{source.id}.{var}.agg", op=Op.AGGREGATE, inputs=(local,), outputs=(var,),
            # Retrieval results from several pieces overlap; per-piece answers stay aligned with their pieces.
            params={"op": "concat", "dedupe": retrieval, "source": source.id, "reads": (f"{source.id}.pieces",)},
            component=source.component, region=source.region,
        ))
    graph.rewire()
    return sorted(region)
