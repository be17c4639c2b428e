"""The pass manager: runs the registered passes to a fixpoint and caches e-graphs.

A p-graph holds no data values (they live in the run's store), so two runs of a
workflow whose p-graphs have the same structure share one e-graph: a cache hit
skips the passes.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from headrace.graph.graph import Graph, _jsonable
from headrace.graph.passes import GraphPass, PassEnv


@dataclass
class OptimizerStats:
    hits: int = 0
    misses: int = 0
    build_seconds: float = 0.0  # time spent in passes and cache lookups, all runs

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class Optimized:
    graph: Graph
    applied: list[tuple[str, list[str]]] = field(default_factory=list)  # (pass, changes) in order
    cached: bool = False


class Optimizer:
    MAX_ROUNDS = 16

    def __init__(self, passes: Mapping[str, GraphPass], cache_size: int = 256) -> None:
        self.passes = dict(passes)
        self.stats = OptimizerStats()
        self._cache: OrderedDict[str, Optimized] = OrderedDict()
        self._cache_size = cache_size

    def optimize(self, pgraph: Graph, env: PassEnv, enabled: Iterable[str] | None = None) -> Optimized:
        """The e-graph for ``pgraph`` with the ``enabled`` passes (all when None)."""
        start = time.perf_counter()
        names = [n for n in self.passes if enabled is None or n in set(enabled)]
        key = self._key(pgraph, env, names)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.stats.hits += 1
            result = Optimized(self._rebind(hit.graph.copy(), pgraph), hit.applied, cached=True)
        else:
            self.stats.misses += 1
            graph = pgraph.copy()
            applied: list[tuple[str, list[str]]] = []
            for _ in range(self.MAX_ROUNDS):
                changed = False
                for name in names:
                    changes = self.passes[name].apply(graph, env)
                    if changes:
                        applied.append((name, changes))
                        changed = True
                if not changed:
                    break
            graph.compute_depths()
            self._cache[key] = Optimized(graph.copy(), applied)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            result = Optimized(graph, applied)
        self.stats.build_seconds += time.perf_counter() - start
        return result

    @staticmethod
    def _rebind(graph: Graph, pgraph: Graph) -> Graph:
        """Params the key cannot see (functions, predicates) come from this run's p-graph, not the cached one's.

        A pass keeps a node's id or derives the new ids from it (``<id>#<stage>``, ``<id>.partial``).
        """
        for node in graph.nodes.values():
            origin = pgraph.nodes.get(node.id) or pgraph.nodes.get(re.sub(r"(#\d+|\.partial)$", "", node.id))
            if origin is not None:
                node.params.update({k: v for k, v in origin.params.items() if not _jsonable(v)})
        return graph

    @staticmethod
    def _key(graph: Graph, env: PassEnv, names: list[str]) -> str:
        shape = json.dumps([graph.to_json(), sorted(env.inputs), names], sort_keys=True, default=str)
        return hashlib.sha256(shape.encode()).hexdigest()
