"""The topology-aware batch policy (Ayo, ASPLOS '25, Algorithm 2)."""

from __future__ import annotations

import anyio
import pytest

from headrace.batching.meta import PrimitiveMeta
from headrace.batching.policies import FifoPolicy, TopologyPolicy, register_batch_policies
from headrace.batching.queue import Pending
from headrace.batching.scheduler import BatchScheduler


def item(name, *, run=None, node=None, depth=0, arrival, size=1):
    meta = None if run is None else PrimitiveMeta(run=run, node=node or name, depth=depth)
    return Pending(payload=name, size=size, meta=meta, arrival=arrival)


def names(batch):
    return [p.payload for p in batch]


def test_registered_next_to_fifo():
    registered = {}
    register_batch_policies(register=lambda name, factory: registered.setdefault(name, factory))
    assert registered == {"fifo": FifoPolicy, "topology": TopologyPolicy}
    assert TopologyPolicy().name == "topology"


def test_figure7_topology_advances_both_runs_where_fifo_does_not():
    queue = [
        item("A", run="q1", depth=3, arrival=1.0),
        item("B", run="q1", depth=1, arrival=1.1),
        item("G", run="q2", depth=3, arrival=2.0),
        item("H", run="q2", depth=1, arrival=2.1),
    ]
    assert names(TopologyPolicy().select(queue, 2)) == ["A", "G"]
    assert names(FifoPolicy().select(queue, 2)) == ["A", "B"]
    # With room for everything, each run's deeper node still goes first.
    assert names(TopologyPolicy().select(queue, 4)) == ["A", "G", "B", "H"]


def test_highest_depth_first_inside_a_bucket():
    queue = [
        item("d0", run="r", depth=0, arrival=1.0),
        item("d2", run="r", depth=2, arrival=2.0),
        item("d1", run="r", depth=1, arrival=3.0),
    ]
    assert names(TopologyPolicy().select(queue, 1)) == ["d2"]
    assert names(TopologyPolicy().select(queue, 3)) == ["d2", "d1", "d0"]


def test_equal_depths_go_by_arrival_and_a_node_takes_its_requests_together():
    queue = [
        item("x1", run="r", node="x", depth=1, arrival=2.0),
        item("y1", run="r", node="y", depth=1, arrival=1.0),
        item("x2", run="r", node="x", depth=1, arrival=3.0),
        item("y2", run="r", node="y", depth=1, arrival=4.0),
        item("o", run="s", depth=0, arrival=1.5),
    ]
    # Run r's bucket visits node y (earliest at its depth) whole, then run s, then node x.
    assert names(TopologyPolicy().select(queue, 5)) == ["y1", "y2", "o", "x1", "x2"]


def test_buckets_ordered_by_their_earliest_arrival():
    queue = [
        item("late-deep", run="late", depth=5, arrival=3.0),
        item("early-shallow", run="early", depth=0, arrival=4.0),
        item("early-first", run="early", depth=0, arrival=1.0),
    ]
    # Run "early" arrived first (t=1), so its bucket leads despite the deeper run.
    assert names(TopologyPolicy().select(queue, 1)) == ["early-first"]
    assert names(TopologyPolicy().select(queue, 3)) == ["early-first", "late-deep", "early-shallow"]


def test_capacity_counts_sizes_and_skips_what_does_not_fit():
    queue = [
        item("a", run="r1", depth=2, arrival=1.0, size=3),
        item("b", run="r2", depth=2, arrival=2.0, size=3),
        item("c", run="r1", depth=1, arrival=3.0, size=2),
        item("d", run="r2", depth=1, arrival=4.0, size=1),
    ]
    # Round 1: r1 gives a (3); r2's b (3) no longer fits, so it is skipped, not split,
    # and r2's next node d (1) fills in; round 2: c (2) does not fit the last slot.
    batch = TopologyPolicy().select(queue, 5)
    assert names(batch) == ["a", "d"]
    assert sum(p.size for p in batch) == 4
    assert names(TopologyPolicy().select(queue, 6)) == ["a", "b"]
    assert names(TopologyPolicy().select(queue, 8)) == ["a", "b", "c"]
    assert names(TopologyPolicy().select(queue, 9)) == ["a", "b", "c", "d"]
    for capacity in range(3, 10):
        assert sum(p.size for p in TopologyPolicy().select(queue, capacity)) <= capacity


def test_an_oversized_first_request_runs_alone():
    queue = [
        item("big", run="r", depth=3, arrival=1.0, size=9),
        item("small", run="r", depth=3, arrival=2.0, size=1),
        item("other", run="s", depth=3, arrival=3.0, size=1),
    ]
    assert names(TopologyPolicy().select(queue, 4)) == ["big"]
    assert names(TopologyPolicy().select([Pending("huge", 9), Pending("x", 1)], 4)) == ["huge"]


def test_requests_without_a_run_behave_like_fifo():
    # Each is a bucket of its own, so they are taken oldest first, exactly as FIFO
    # takes them (arrival decides, not queue position).
    queue = [Pending(payload=i, size=1, arrival=float(i)) for i in (2, 0, 3, 1)]
    for capacity in (1, 2, 3, 4, 8):
        assert names(TopologyPolicy().select(queue, capacity)) == [0, 1, 2, 3][:capacity]
    sizes = [3, 2, 4, 1]
    queue = [Pending(payload=i, size=s, arrival=float(i)) for i, s in enumerate(sizes)]
    for capacity in (1, 2, 3, 5, 9, 10):
        assert names(TopologyPolicy().select(queue, capacity)) == names(FifoPolicy().select(queue, capacity))
    # Where FIFO would stop at a request that does not fit, it is skipped for a later
    # batch and a smaller, later one fills the slot.
    assert names(FifoPolicy().select(queue, 6)) == [0, 1]
    assert names(TopologyPolicy().select(queue, 6)) == [0, 1, 3]
    assert names(FifoPolicy().select(queue, 4)) == [0]
    assert names(TopologyPolicy().select(queue, 4)) == [0, 3]


def test_empty_queue_gives_an_empty_batch():
    assert TopologyPolicy().select([], 4) == []


class Record:
    """A real batch function: upper-cases each payload's text, recording each batch."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def __call__(self, payloads):
        self.batches.append(list(payloads))
        await anyio.sleep(0.01)
        return [p.upper() for p in payloads]


@pytest.mark.anyio
async def test_scheduler_with_topology_batches_the_deep_nodes_of_both_runs():
    runner = Record()
    sched = BatchScheduler("rec", runner, TopologyPolicy(), max_batch_size=2, max_wait_ms=200)
    results = {}

    async def one(text, meta):
        results[text] = await sched.submit(text, 1, meta)

    async with anyio.create_task_group() as outer:
        await outer.start(sched.run)
        async with anyio.create_task_group() as tg:
            # All three are queued before the scheduler wakes to form its batch.
            tg.start_soon(one, "a", PrimitiveMeta(run="r1", node="A", depth=3))
            tg.start_soon(one, "b", PrimitiveMeta(run="r1", node="B", depth=1))
            tg.start_soon(one, "g", PrimitiveMeta(run="r2", node="G", depth=3))
        outer.cancel_scope.cancel()

    assert results == {"a": "A", "b": "B", "g": "G"}
    assert runner.batches == [["a", "g"], ["b"]]
