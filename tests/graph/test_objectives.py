"""Performance objectives and task groups deduced from the graph (Parrot §5.2, Figure 9), on hand-built graphs.

And that the executor hands them to the schedulers in each request's ``PrimitiveMeta``.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from headrace.batching.policies import FifoPolicy
from headrace.batching.resolved import ResolvedEngine
from headrace.batching.requests import runner_for
from headrace.batching.scheduler import BatchScheduler
from headrace.graph.executor import Executor, Run
from headrace.graph.graph import Graph, Node, Op
from headrace.graph.objectives import objectives, task_groups
from headrace.graph.regions import map_over


def llm_call(g: Graph, name: str, inputs: tuple[str, ...], output: str, component: str = "") -> None:
    """An LLM call as the graph builder makes one: a prefill, then a decode of its context."""
    g.add(Node(f"{name}.prefill", Op.PREFILL, engine="lm", inputs=inputs, outputs=(f"{name}.ctx",),
               component=component or name))
    g.add(Node(name, Op.DECODE, engine="lm", inputs=(f"{name}.ctx",), outputs=(output,), component=component or name))


def fn(node_id: str, inputs: tuple[str, ...], output: str, f=lambda *a: a) -> Node:
    return Node(node_id, Op.FUNCTION, inputs=inputs, outputs=(output,), params={"fn": f})


def finish(g: Graph) -> Graph:
    g.rewire()
    g.compute_depths()
    return g


def latency(g: Graph, outputs=()) -> set[str]:
    return {n for n, objective in objectives(g, outputs).items() if objective == "latency"}


def test_figure9_output_calls_and_their_predecessor_are_latency_critical_and_the_maps_a_task_group():
    # Two parallel maps -> one reduce -> two answers, each an output of the run.
    g = Graph("figure9")
    llm_call(g, "map_0", ("chunk_0",), "s0", component="map")
    llm_call(g, "map_1", ("chunk_1",), "s1", component="map")
    llm_call(g, "reduce", ("s0", "s1"), "summary")
    llm_call(g, "ask_x", ("summary",), "x", component="ask")
    llm_call(g, "ask_y", ("summary",), "y", component="ask")
    finish(g)

    # The calls producing x and y, and the call right before them (the reduce), whole: decode and prefill.
    assert latency(g, ["x", "y"]) == {"ask_x", "ask_x.prefill", "ask_y", "ask_y.prefill", "reduce", "reduce.prefill"}
    assert objectives(g, ["x", "y"])["map_0"] == "throughput"
    # Each stage of parallel calls is a task group: the maps' prefills, the maps' decodes, the two answers.
    groups = task_groups(g)
    assert groups["map_0"] == groups["map_1"] != groups["map_0.prefill"] == groups["map_1.prefill"]
    assert groups["ask_x"] == groups["ask_y"] not in (groups["map_0"], groups["map_0.prefill"])
    assert "reduce" not in groups and "reduce.prefill" not in groups  # alone in its stage
    assert len(set(groups.values())) == 4
    # Only x wanted: ask_y is work nobody waits on at once.
    assert latency(g, ["x"]) == {"ask_x", "ask_x.prefill", "reduce", "reduce.prefill"}


def test_steps_with_no_engine_are_looked_through_to_the_requests_around_them():
    # embed -> search -> merge (a function) -> call -> join (a function) -> answer
    g = Graph("rag")
    g.add(Node("embed", Op.EMBED, engine="emb", inputs=("question",), outputs=("qv",), component="embed"))
    g.add(Node("search", Op.SEARCH, engine="vs", inputs=("qv",), outputs=("hits",), component="search"))
    g.add(fn("merge", ("hits",), "pool"))
    llm_call(g, "synth", ("pool",), "text")
    g.add(fn("join", ("text",), "answer"))
    finish(g)
    # join produces the answer, so the call behind it produces it; merge is no request, so the
    # search behind it is the call's predecessor. The embed two requests back is throughput.
    assert latency(g, ["answer"]) == {"synth", "synth.prefill", "search"}
    assert task_groups(g) == {}


def test_a_split_prefill_belongs_to_its_call():
    g = Graph("split")
    g.add(Node("call.prefill.partial", Op.PARTIAL_PREFILL, engine="lm", outputs=("head.ctx",), component="call"))
    g.add(Node("call.prefill", Op.FULL_PREFILL, engine="lm", inputs=("doc", "head.ctx"), outputs=("call.ctx",),
               component="call"))
    g.add(Node("call", Op.DECODE, engine="lm", inputs=("call.ctx",), outputs=("answer",), component="call"))
    g.add(Node("read", Op.EMBED, engine="emb", inputs=("file",), outputs=("doc",), component="read"))
    finish(g)
    assert latency(g, ["answer"]) == {"call", "call.prefill", "call.prefill.partial", "read"}


def test_without_named_outputs_the_sinks_produce_them():
    # A plain chat request: one call, nothing after it.
    g = Graph("request")
    llm_call(g, "chat", ("prompt",), "text")
    finish(g)
    assert objectives(g) == {"chat.prefill": "latency", "chat": "latency"}
    assert task_groups(g) == {}


def test_a_chain_of_one_component_is_no_task_group_but_a_regions_instances_are():
    g = Graph("chain")
    llm_call(g, "step_0", ("doc",), "s0", component="step")
    llm_call(g, "step_1", ("s0",), "s1", component="step")  # one depth further down: not parallel
    g.add(fn("split", ("s1",), "items", str.split))
    g.add(Node("embed", Op.EMBED, engine="emb", inputs=("items",), outputs=("vectors",), component="embed"))
    g.add(fn("count", ("vectors",), "n", len))
    finish(g)
    map_over(g, g.nodes["split"], {"embed"})
    g.compute_depths()
    groups = task_groups(g)
    assert groups == {"embed": f"split/embed.embed@{g.nodes['embed'].depth}"}


@pytest.mark.anyio
async def test_the_executor_hands_each_request_its_primitive_meta():
    g = Graph("meta")
    g.add(fn("split", ("text",), "items", str.split))
    g.add(Node("embed", Op.EMBED, engine="emb", inputs=("items",), outputs=("vectors",), component="embed"))
    g.add(fn("count", ("vectors",), "n", lambda v: tuple(v.shape)))
    finish(g)
    map_over(g, g.nodes["split"], {"embed"})
    g.compute_depths()

    class Lengths:
        """A real (tiny) embed engine: a text's vector is [its length]."""

        name, kind = "emb", "embed"

        async def embed(self, texts):
            return torch.tensor([[float(len(t))] for t in texts])

    class Recording(BatchScheduler):
        """The real scheduler, noting the metadata of each request it is given."""

        seen: list = []

        async def submit(self, request, size, meta=None):
            self.seen.append(meta)
            return await super().submit(request, size, meta)

    sched = Recording("emb", runner_for(Lengths()), FifoPolicy(), max_batch_size=8, max_wait_ms=0)
    run = Run(workflow="t", graph=g, inputs={"text": "a bb ccc"}, outputs=("n",), policy="topology", slo_seconds=5.0)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await Executor({"emb": ResolvedEngine(Lengths(), sched)}.__getitem__).execute(run)
        tg.cancel_scope.cancel()
    assert run.status == "succeeded", run.error
    assert run.result == {"n": (3, 1)}
    assert sorted(m.key for m in sched.seen) == [(0,), (1,), (2,)]
    for meta in sched.seen:
        assert (meta.run, meta.node, meta.depth) == (run.id, "embed", g.nodes["embed"].depth)
        assert meta.task_group == task_groups(g)["embed"] and meta.objective == objectives(g, ["n"])["embed"]
        assert meta.arrival == run.arrival and meta.deadline == run.arrival + 5.0 and meta.policy == "topology"


def test_variables_awaited_for_latency_or_throughput_set_a_sessions_objectives():
    from headrace.graph.objectives import awaited_objectives

    g = Graph("session")
    llm_call(g, "first", ("doc",), "summary")
    llm_call(g, "second", ("summary",), "title")
    llm_call(g, "third", ("title",), "question")
    llm_call(g, "side", ("doc",), "keywords")
    finish(g)
    critical = lambda d: {n for n, o in d.items() if o == "latency"}  # noqa: E731
    # Awaited for latency: its producer and the call right before it (Parrot §5.2), nothing else.
    assert critical(awaited_objectives(g, ["question"], ["keywords"])) == {
        "second.prefill", "second", "third.prefill", "third"}
    # None awaited for latency: the sinks are, except what a throughput variable depends on.
    assert critical(awaited_objectives(g, [], ["keywords"])) == critical(awaited_objectives(g, [], [])) - {
        "side.prefill", "side"}
    assert {"side", "third"} <= critical(awaited_objectives(g, [], []))
    # A variable no call produces (the client sets it) changes nothing.
    assert awaited_objectives(g, ["doc"], []) == awaited_objectives(g, [], [])
