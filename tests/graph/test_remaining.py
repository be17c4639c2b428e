"""What a run has left: the least time from a node's start to its run's end, per workflow."""

from __future__ import annotations

from headrace.graph.remaining import RemainingWork


def test_keeps_the_shortest_time_from_each_node_to_its_runs_end():
    work = RemainingWork()
    assert work.of("rag") == {}
    seen = work.of("rag")  # live: a run that started before another finished sees what it taught
    work.observe("rag", [("retrieve", 100.0), ("answer", 104.0)], finished=110.0)
    assert seen == {"retrieve": 10.0, "answer": 6.0}
    work.observe("rag", [("retrieve", 200.0), ("answer", 201.0), ("answer", 207.0)], finished=215.0)
    # answer ran twice in that run (two pieces of a region): the later start bounds it
    assert work.of("rag") == {"retrieve": 10.0, "answer": 6.0}
    work.observe("rag", [("retrieve", 300.0)], finished=308.0)
    assert work.of("rag")["retrieve"] == 8.0
    assert work.of("summary") == {}


def test_a_workflow_forgets_its_least_recently_seen_nodes_past_the_bound():
    work = RemainingWork(nodes_per_workflow=3)
    work.observe("agent", [(f"step{i}", float(i)) for i in range(5)], finished=10.0)
    assert sorted(work.of("agent")) == ["step2", "step3", "step4"]
    work.observe("agent", [("step2", 0.0), ("step9", 0.0)], finished=1.0)
    assert sorted(work.of("agent")) == ["step2", "step4", "step9"]
