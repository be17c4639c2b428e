"""The run history bounded in bytes ([workflows] run_history_mib): past the budget the oldest finished runs
keep their summary and timeline and drop the rest, then go whole; a running run is never touched.

The runs are traced workflows of calculator calls with a large text input: no engine, no model.
"""

from __future__ import annotations

import json

import anyio

from headrace.graph.run_history import drop_details, graph_and_dot, passes, retained_bytes, timeline
from headrace.graph.service import WorkflowService
from headrace.graph.workflow import Workflow

TEXT = "The headrace carries the water from the river to the mill wheel. " * 1000  # 65 KB a run's inputs hold


async def sums(t):
    first, second = t.tool("calculator", "1 + 2"), t.tool("calculator", "3 * 4")
    return {"answer": [await first, await second]}


def service(budget_bytes: int, body=sums, keep_runs: int = 1000) -> WorkflowService:
    def resolve(name):
        raise LookupError(f"no engine {name!r} in an offline test")

    workflow = Workflow("sums", "calculator calls", {"text": {"type": "string"}}, trace=body, outputs=("answer",),
                        kinds=())
    return WorkflowService({"sums": workflow}, {}, resolve, dict, keep_runs=keep_runs, run_history_bytes=budget_bytes)


def books_match(svc: WorkflowService, runs: list) -> bool:
    """The history's total is what its runs hold, measured now (to CPython's shared-key dicts' few bytes)."""
    now = sum(retained_bytes(r) for r in runs)
    return abs(svc.history.total_bytes - now) <= 0.01 * now


def run_many(svc: WorkflowService, n: int) -> list:
    async def go():
        async with svc:
            return [await svc.run("sums", {"text": f"{i} {TEXT}"}) for i in range(n)]

    return anyio.run(go)


def one_run_sizes() -> tuple[int, int]:
    """(bytes a finished run holds, bytes its summary alone holds)."""
    (run,) = run_many(svc := service(2**40), 1)
    full = svc.history.total_bytes
    drop_details(run)
    return full, retained_bytes(run)


def test_the_measure_counts_what_a_finished_run_holds_and_dropping_details_frees_most_of_it():
    full, summary = one_run_sizes()
    assert full > len(TEXT) > 5 * summary  # the inputs are counted; the summary is a fraction of them


def test_past_the_budget_the_oldest_runs_keep_summary_and_timeline_and_drop_the_rest():
    full, summary = one_run_sizes()
    budget = 3 * full + 5 * summary
    svc = service(budget)
    runs = run_many(svc, 10)
    assert all(r.status == "succeeded" and r.result == {"answer": ["3", "12"]} for r in runs)
    assert list(svc.runs.values()) == runs  # the summaries fit: no run went whole
    dropped = [r.details_dropped for r in runs]
    n = dropped.count(True)
    assert dropped == [True] * n + [False] * (10 - n) and 6 <= n <= 8, dropped  # oldest first
    assert svc.history.total_bytes <= budget
    assert books_match(svc, runs)
    for r in runs[:n]:
        assert r.inputs == {} and not r.graph.nodes and r.applied == [] and r.growth is None
        assert r.events.closed and r.events.next_seq == 0
        assert r.result == {"answer": ["3", "12"]} and r.status == "succeeded" and r.error is None
        assert [node["node"] for node in timeline(r)] == ["calculator.1", "calculator.2"]  # the timeline stays
        assert all(node["start"] is not None and node["end"] is not None and node["pieces"] == []
                   for node in timeline(r))
    for r in runs[n:]:
        assert r.inputs["text"].endswith(TEXT) and set(r.graph.nodes) == {"calculator.1", "calculator.2"}


def test_past_the_budget_with_summaries_alone_the_oldest_runs_go_whole():
    full, summary = one_run_sizes()
    budget = 3 * summary + summary // 2
    svc = service(budget)
    runs = run_many(svc, 8)
    assert list(svc.runs.values()) == runs[-3:]  # the newest three summaries
    assert all(r.details_dropped for r in svc.runs.values())
    assert 0 < svc.history.total_bytes <= budget


def test_older_finished_runs_are_packed_and_serve_the_same_graph_timeline_and_passes():
    svc = service(2**40)
    svc.history.live_finished = 2

    async def go():
        async with svc:
            runs, seen = [], []
            for i in range(5):
                run = await svc.run("sums", {"text": f"{i} {TEXT}"})
                runs.append(run)
                served = json.loads(json.dumps([timeline(run), passes(run), graph_and_dot(run)]))  # as a client reads it
                seen.append((*served, retained_bytes(run)))
            return runs, seen

    runs, seen = anyio.run(go)
    assert [r.packed is not None for r in runs] == [True, True, True, False, False]  # the newest two stay live
    for run, (nodes, applied, (graph, dot), live_bytes) in zip(runs, seen):
        assert json.loads(json.dumps([timeline(run), passes(run), graph_and_dot(run)])) == [nodes, applied, [graph, dot]]
        assert [n["id"] for n in graph["nodes"]] == ["calculator.1", "calculator.2"] and "calculator.1" in dot
        assert run.result == {"answer": ["3", "12"]} and not run.details_dropped
        if run.packed is not None:
            assert run.inputs == {} and not run.graph.nodes and run.records == [] and run.applied == []
            assert retained_bytes(run) < live_bytes / 5  # the inputs went; the rest is a few KiB compressed
        else:
            assert run.inputs["text"].endswith(TEXT) and set(run.graph.nodes) == {"calculator.1", "calculator.2"}
    assert books_match(svc, runs)
    drop_details(runs[0])  # a packed run past the budget keeps its timeline, without piece timings
    assert [n["node"] for n in timeline(runs[0])] == ["calculator.1", "calculator.2"] and passes(runs[0]) == []


def test_keep_runs_still_caps_the_count_and_its_evictions_leave_the_books():
    svc = service(2**40, keep_runs=3)
    runs = run_many(svc, 5)
    assert list(svc.runs.values()) == runs[-3:]
    assert books_match(svc, runs[-3:])
    assert not any(r.details_dropped for r in runs)


def test_a_running_run_is_never_touched():
    gate = anyio.Event()

    async def waits(t):
        if t.run.inputs["text"] == "wait":
            await gate.wait()
        return await sums(t)

    svc = service(1, body=waits)  # one byte: every finished run goes as soon as it ends

    async def go():
        async with svc:
            held = svc.prepare("sums", {"text": "wait"}, {})
            svc.start(held)
            with anyio.fail_after(30):
                while held.status != "running":
                    await anyio.sleep(0.01)
                done = [await svc.run("sums", {"text": TEXT}) for _ in range(4)]
                assert all(r.status == "succeeded" and r.id not in svc.runs for r in done)
                assert held.id in svc.runs and not held.details_dropped and held.inputs == {"text": "wait"}
                assert held.events.next_seq > 0 and svc.history.total_bytes == 0
                gate.set()
                await held.done.wait()
            assert held.status == "succeeded" and held.id not in svc.runs  # finished: now it counts
            assert svc.history.total_bytes == 0

    anyio.run(go)
