"""Built-in batch policies (a plugin: registered through ``register_batch_policies``).

A policy picks which queued requests form the next batch. The scheduler hands it
the queue in arrival order and the batch's capacity in items.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence

from headrace.batching.queue import Pending
from headrace.plugins.hookspecs import hookimpl


class BatchPolicy(Protocol):
    name: str

    def select(self, queue: Sequence[Pending], capacity: int) -> list[Pending]:
        """The requests to run next; never empty when the queue is not."""
        ...


class FifoPolicy:
    """Blind request-level batching, as a plain server does: oldest first until full.

    A request larger than the whole capacity still runs, alone, rather than starve.
    """

    name = "fifo"

    def select(self, queue: Sequence[Pending], capacity: int) -> list[Pending]:
        batch: list[Pending] = []
        used = 0
        for item in queue:
            if batch and used + item.size > capacity:
                break
            batch.append(item)
            used += item.size
        return batch


class TopologyPolicy:
    """Topology-aware batching: Ayo (ASPLOS '25) Algorithm 2, Event 2 (section 5.2).

    Queued requests are grouped into buckets by ``meta.run`` (one bucket per query;
    a request with no run, such as a plain OpenAI call, is a bucket of its own).
    Buckets are ordered by their earliest arrival. The walk visits the buckets in
    that order, round-robin: each visit takes the requests of the bucket's current
    highest-depth node (``meta.depth``, higher = more downstream work waits on
    it; ties go to the node that arrived first), then moves on to the next bucket,
    until ``capacity`` items are taken or nothing more fits. This batches A and G
    of Figure 7 (advancing both queries) where FIFO would batch A and B.

    A request larger than the slots left is skipped for a later batch, never split;
    the first candidate still runs, alone, when it exceeds the whole capacity.
    Requests of a node are told apart by ``meta.node`` (no node: the request is
    its own node). The order returned is the order taken, which is deterministic.
    """

    name = "topology"

    def select(self, queue: Sequence[Pending], capacity: int) -> list[Pending]:
        # Bucket by run; each bucket's items by depth (highest first), then arrival
        # (queue position breaks arrival ties, keeping the order deterministic).
        buckets: dict[Hashable, list[tuple[int, Pending]]] = {}
        for index, item in enumerate(queue):
            run = run_of(item)
            key: Hashable = ("solo", id(item)) if run is None else ("run", run)
            buckets.setdefault(key, []).append((index, item))
        for items in buckets.values():
            items.sort(key=lambda e: (-_depth(e[1]), e[1].arrival, e[0]))
        order = sorted(buckets.values(), key=lambda items: min((p.arrival, i) for i, p in items))

        batch: list[Pending] = []
        used = 0
        progressed = True
        while progressed and used < capacity:
            progressed = False
            for items in order:
                if used >= capacity:
                    break
                # Drop what can no longer fit: the slots left only shrink.
                if batch:
                    items[:] = [e for e in items if e[1].size <= capacity - used]
                if not items:
                    continue
                node = _node(items[0][1])
                kept: list[tuple[int, Pending]] = []
                for entry in items:
                    item = entry[1]
                    if _node(item) == node and (not batch or used + item.size <= capacity):
                        batch.append(item)
                        used += item.size
                        progressed = True
                    else:
                        kept.append(entry)
                items[:] = kept
        return batch


def run_of(item: Pending) -> str | None:
    return None if item.meta is None else item.meta.run


def _depth(item: Pending) -> int:
    return 0 if item.meta is None else item.meta.depth


def _node(item: Pending) -> Hashable:
    node = None if item.meta is None else item.meta.node
    return ("item", id(item)) if node is None else ("node", node)


@hookimpl
def register_batch_policies(register):
    register("fifo", FifoPolicy)
    register("topology", TopologyPolicy)
