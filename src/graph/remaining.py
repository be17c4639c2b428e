"""How much of a run is left once a primitive starts: learned from the runs of its workflow that finished.

For each workflow and node, the shortest time any succeeded run took from the node's start to
the run's end. The shortest, not the mean: under load every duration stretches, and the
``deadline`` policy needs a bound that never calls a run that can still make its SLO late. It is
measured from the node's start to the run's end, not summed over the graph, so the overlap that
pipelining and parallel branches give is already in it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping

# A traced workflow names a node per step; past this many a workflow forgets its least recently seen.
NODES_PER_WORKFLOW = 4096


class RemainingWork:
    def __init__(self, nodes_per_workflow: int = NODES_PER_WORKFLOW) -> None:
        self._limit = nodes_per_workflow
        self._shortest: dict[str, OrderedDict[str, float]] = {}

    def observe(self, workflow: str, starts: Iterable[tuple[str, float]], finished: float) -> None:
        """A run of ``workflow`` succeeded at ``finished``; ``starts``: when each of its nodes started (``time.monotonic``)."""
        table = self._shortest.setdefault(workflow, OrderedDict())
        for node, started in starts:
            left = max(0.0, finished - started)
            known = table.pop(node, None)
            table[node] = left if known is None else min(known, left)
        while len(table) > self._limit:
            table.popitem(last=False)

    def of(self, workflow: str) -> Mapping[str, float]:
        """Node id -> the shortest time from its start to its run's end seen so far (absent: never seen)."""
        return self._shortest.setdefault(workflow, OrderedDict())  # live: what later runs teach, running ones see
