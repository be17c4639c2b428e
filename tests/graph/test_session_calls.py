"""A session's calls as graph nodes (no model): prompts per output, task groups, objectives, refusals."""

from __future__ import annotations

import anyio
import pytest

from headrace.graph.executor import Executor
from headrace.graph.graph import Op
from headrace.graph.sessions import SessionError, SessionManager
from headrace.plugins.protocols import SamplingParams

pytestmark = pytest.mark.anyio
DEFAULT = SamplingParams(max_tokens=16)


def no_engines(name):
    raise LookupError(name)


async def session_with(test) -> None:
    manager = SessionManager(Executor(no_engines), no_engines, dict, idle_seconds=60)
    async with anyio.create_task_group() as tg:
        await tg.start(manager.run)
        try:
            await test(manager.create(owner=None))
        finally:
            tg.cancel_scope.cancel()


async def test_each_output_is_generated_from_the_text_before_it():
    async def test(session):
        session.create_variable("river", "the Thames")
        call = session.add_call("Name a town on {{input:river}}: {{output:town}}\nA bridge there: {{output:bridge}}",
                                {"bridge": SamplingParams(max_tokens=3)}, DEFAULT, "lm", None)
        g = session.run.graph
        first, second = (g.nodes[f"{call.id}.{i}.prefill"] for i in range(2))
        assert first.params["prompt"] == "Name a town on {{input:river}}: "
        assert second.params["prompt"] == "Name a town on {{input:river}}: {{input:town}}\nA bridge there: "
        assert second.inputs == ("river", "town") and first.op == second.op == Op.PREFILL
        decodes = [g.nodes[f"{call.id}.{i}.decode"] for i in range(2)]
        assert [d.outputs for d in decodes] == [("town",), ("bridge",)]
        assert [d.params["sampling"].max_tokens for d in decodes] == [16, 3]
        assert g.parents(second.id) == [decodes[0].id]  # the second output waits for the first
        assert first.prefix_hash == second.prefix_hash  # the same static text before the first placeholder

    await session_with(test)


async def test_calls_of_one_template_at_one_depth_are_a_task_group_and_criteria_set_objectives():
    async def test(session):
        maps = []
        for i in range(3):
            session.create_variable(f"doc{i}", f"document {i}")
            maps.append(session.add_call(f"Summarize: {{{{input:doc{i}}}}} {{{{output:part{i}}}}}", {}, DEFAULT,
                                         "lm", None))
        reduce = session.add_call("Combine: {{input:part0}} {{input:part1}} {{input:part2}} {{output:all}}", {},
                                  DEFAULT, "lm", None)
        title = session.add_call("Title: {{input:all}} {{output:title}}", {}, DEFAULT, "lm", None)
        groups = session.growth.task_groups
        assert len({groups[f"{c.id}.0.decode"] for c in maps}) == 1
        assert f"{reduce.id}.0.decode" not in groups
        # Nothing awaited: the sink (title) and the call before it are latency-critical.
        assert [session.call_objective(c) for c in (*maps, reduce, title)] == ["throughput"] * 3 + ["latency"] * 2
        session.variables["all"].criteria = "latency"
        session._deduce()
        assert [session.call_objective(c) for c in (*maps, reduce, title)] == ["latency"] * 4 + ["throughput"]

    await session_with(test)


async def test_a_refused_call_leaves_the_graph_and_the_variables_as_they_were():
    async def test(session):
        session.create_variable("a")
        session.add_call("{{input:a}} {{output:b}}", {}, DEFAULT, "lm", None)
        before = (set(session.run.graph.nodes), set(session.run.graph.edges))
        with pytest.raises(SessionError) as refused:
            session.add_call("{{input:b}} {{output:a}}", {}, DEFAULT, "lm", None)
        assert (refused.value.field, refused.value.code) == ("template", "cycle")
        assert (set(session.run.graph.nodes), set(session.run.graph.edges)) == before
        assert session.variables["a"].producer is None and len(session.calls) == 1
        with pytest.raises(SessionError) as refused:
            session.add_call("{{output:b}}", {}, DEFAULT, "lm", None)
        assert (refused.value.code, refused.value.status) == ("output_bound_twice", 409)

    await session_with(test)
