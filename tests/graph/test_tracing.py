"""Traced workflows: handles, loops, branches, the step bound, failures, cancel, and the passes on
issued-but-unawaited calls.

The fast tests trace bodies that call the built-in calculator (a function primitive, no model)
on a workflow service with no engine loaded; the pass tests issue LLM and search calls there and
check the graph the passes made before any engine is reached. The ``slow`` tests run traced
bodies on the default config's real engines.
"""

from __future__ import annotations

import time

import anyio
import pytest

from conftest import idle
from headrace.graph.graph import Op
from headrace.graph.service import WorkflowService
from headrace.graph.tools import ToolError, calculate
from headrace.graph.tracing import CallFailed
from headrace.graph.workflow import Workflow

ENGINES = {"llm": "smollm2", "embed": "all-minilm-l6-v2", "vector_store": "lancedb"}
HEADRACE = "A headrace is the channel that carries water from the river to the mill wheel."
BASALT = "Basalt columns form when thick lava flows cool slowly and crack into hexagons."


def offline(registry, body, max_steps: int = 64, inputs=None, outputs=("answer",)) -> WorkflowService:
    """A service whose one workflow is ``body``; no engine is loaded (a primitive that needs one fails)."""

    def resolve(name):
        raise LookupError(f"no engine {name!r} in an offline test")

    workflow = Workflow("traced", "a test body", inputs or {"n": {"type": "integer", "default": 3}},
                        trace=body, outputs=outputs, kinds=())
    return WorkflowService({"traced": workflow}, registry.passes, resolve, lambda: dict(ENGINES),
                           max_traced_steps=max_steps)


def run(svc: WorkflowService, inputs=None, config=None):
    async def go():
        r = svc.prepare("traced", inputs or {}, config or {})
        await svc.execute(r)
        return r

    return anyio.run(go)


def test_calls_return_handles_and_join_the_graph_before_any_is_awaited(registry):
    seen = {}

    async def body(t):
        sums = [t.tool("calculator", f"{i} + {i}") for i in range(3)]
        seen["issued"] = len(t.run.graph.nodes)  # nothing sent yet: the body has not suspended
        await t.flush()  # what awaiting anything does first: what was issued goes to the graph, as one set
        seen["graph"] = set(t.run.graph.nodes)
        later = t.tool("calculator", "1 + 1")
        with anyio.fail_after(30):  # awaiting anything, not only a handle, sends what was issued
            while "calculator.4" not in t.run.graph.nodes:
                await anyio.sleep(0.01)
        return {"answer": [await s for s in (*sums, later)]}

    r = run(offline(registry, body))
    assert r.status == "succeeded", r.error
    assert r.result["answer"] == ["0", "2", "4", "2"]
    assert seen["issued"] == 0 and seen["graph"] == {"calculator.1", "calculator.2", "calculator.3"}


def test_a_handle_feeds_a_later_call_without_being_awaited(registry):
    async def body(t):
        a = t.tool("calculator", "6 * 7")
        b = t.tool("calculator", a)  # an edge of the graph, not a wait in Python
        return {"answer": await b}

    r = run(offline(registry, body))
    assert r.status == "succeeded" and r.result["answer"] == "42"
    assert r.graph.parents("calculator.2") == ["calculator.1"]


def test_a_loop_and_a_data_dependent_branch(registry):
    async def body(t):
        total, path = "1", []
        for _ in range(t.inputs["n"]):  # the bound comes from the inputs, the exit from a value
            total = await t.tool("calculator", f"{total} * 3")
            if int(total) > 20:
                path.append("big")
                total = await t.tool("calculator", f"{total} - 20", name="shrink")
            else:
                path.append("small")
        return {"answer": total, "path": path}

    r = run(offline(registry, body, outputs=("answer", "path")), {"n": 4})
    assert r.status == "succeeded", r.error
    # 3, 9, 27 -> 7, 21 -> 1
    assert r.result == {"answer": "1", "path": ["small", "small", "big", "big"]}
    assert sorted(n for n in r.graph.nodes if n.startswith("shrink")) == ["shrink.4", "shrink.6"]


def test_the_step_bound_fails_the_run_with_a_clear_error(registry):
    async def body(t):
        n = "0"
        while True:  # never ends on its own
            n = await t.tool("calculator", f"{n} + 1")

    r = run(offline(registry, body, max_steps=5))
    assert r.status == "failed"
    assert "more than 5 engine calls" in r.error and "max_traced_steps" in r.error
    assert len(r.graph.nodes) == 5 and all(rec.state == "done" for rec in r.records)


def test_a_failed_call_fails_its_handle_and_the_body_may_go_on(registry):
    async def body(t):
        try:
            await t.tool("calculator", "__import__('os')")
        except CallFailed as exc:
            error = str(exc)
        return {"answer": error}

    r = run(offline(registry, body))
    assert r.status == "succeeded"
    assert "calculator.1" in r.result["answer"] and "not Call" in r.result["answer"]
    assert [rec.state for rec in r.records] == ["failed"]


def test_an_uncaught_failure_or_a_bad_call_fails_the_run(registry):
    async def unguarded(t):
        return {"answer": await t.tool("calculator", "1 / 0")}

    r = run(offline(registry, unguarded))
    assert r.status == "failed" and "division by zero" in r.error and "calculator.1" in r.error

    async def bad_prompt(t):
        return {"answer": await t.llm.generate("Q: {{input:question}}", inputs={})}

    r = run(offline(registry, bad_prompt))
    assert r.status == "failed" and "['question'] have no value" in r.error


def test_cancel_mid_loop(registry):
    async def body(t):
        n = "0"
        for _ in range(1000):
            n = await t.tool("calculator", f"{n} + 1")
            await anyio.sleep(0.01)
        return {"answer": n}

    svc = offline(registry, body)

    async def go():
        r = svc.prepare("traced", {}, {})
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.execute, r)
            while len(r.records) < 3:
                await anyio.sleep(0.01)
            svc.cancel(r.id)
        return r

    r = anyio.run(go)
    assert r.status == "cancelled" and r.done.is_set()
    assert 3 <= len(r.graph.nodes) < 1000 and not any(rec.state == "running" for rec in r.records)


def test_passes_apply_to_issued_but_unawaited_calls(registry):
    """A split decode whose pieces an unawaited search reads is pipelined into it; an answer prompt whose
    context is that search's unawaited hits has its ready prefix split off to prefill early."""
    shapes = {}

    async def body(t):
        queries = t.llm.generate("List three search queries about: {{input:question}}", split="lines",
                                 inputs={"question": t.inputs["question"]}, name="expand")
        hits = t.search(queries, collection="mills", name="search")
        answer = t.llm.generate("Answer the question from the context.\nQuestion: {{input:question}}\n"
                                "Context: {{input:context}}\nAnswer:",
                                inputs={"question": t.inputs["question"], "context": hits}, name="answer")
        await t.flush()
        graph = t.run.graph
        shapes["ops"] = {n: str(node.op) for n, node in graph.nodes.items()}
        shapes["regions"] = {n: node.region for n, node in graph.nodes.items() if node.region}
        shapes["applied"] = [name for name, _ in t.run.applied]
        with pytest.raises(CallFailed):  # no engine is loaded: the graph is what this test checks
            await answer
        return {"answer": ""}

    r = run(offline(registry, body, inputs={"question": {"type": "string"}}), {"question": "What is a headrace?"})
    assert r.status == "succeeded", r.error
    ops, regions = shapes["ops"], shapes["regions"]
    assert ops["expand.1"] == "partial_decode"
    assert regions == {"search.2.embed": "expand.1", "search.2": "expand.1"}  # once per streamed query
    assert ops["answer.3.prefill"] == "full_prefill" and ops["answer.3.prefill.partial"] == "partial_prefill"
    assert {"decode_pipelining", "prefill_split"} <= set(shapes["applied"])


def test_the_schedulers_see_unawaited_calls_as_task_groups_with_objectives(registry):
    seen = {}

    async def body(t):
        drafts = [t.llm.generate("Say {{input:x}}.", inputs={"x": str(i)}, name="agent") for i in range(2)]
        pick = t.llm.generate("Pick one: {{input:a}} or {{input:b}}", inputs={"a": drafts[0], "b": drafts[1]},
                              choices=["a", "b"], name="judge")
        await t.flush()
        seen["groups"], seen["objectives"] = dict(t.growth.task_groups), dict(t.growth.objectives)
        with pytest.raises(CallFailed):  # no engine is loaded
            await pick
        return {"answer": ""}

    r = run(offline(registry, body))
    assert r.status == "succeeded", r.error
    groups, objectives = seen["groups"], seen["objectives"]
    assert groups["agent.1"] == groups["agent.2"]  # a stage's parallel calls, issued before any is awaited
    assert objectives["judge.3"] == "latency" and objectives["agent.1"] == "latency"  # the output and the calls before it


def test_calculator_is_arithmetic_only():
    assert calculate("12 * (3 + 4)") == "84"
    assert calculate("7 / 2") == "3.5" and calculate("2^10") == "1024" and calculate("-3 % 2") == "1"
    for bad in ("__import__('os').system('true')", "x + 1", "(1).real", "2 ** 1000", "9" * 300, "", "[1, 2]",
                "1 if 1 else 2", "1 / 0"):
        with pytest.raises(ToolError):
            calculate(bad)


def test_a_workflow_is_a_template_or_a_trace():
    async def body(t):
        return {}

    with pytest.raises(ValueError, match="either a build"):
        Workflow("neither", "", {})
    with pytest.raises(ValueError, match="either a build"):
        Workflow("both", "", {}, build=lambda i, c, e: None, trace=body)


# live: traced bodies on the real engines ----------------------------------------------------


@pytest.mark.slow
def test_live_handles_share_a_prefilled_prefix_and_cancel_frees_the_contexts(live):
    """A prefix prefilled once and continued by two generations, a rerank and an embed, then a loop of
    generations cancelled midway: the run ends cancelled with no context left on the engine."""
    portal, svc, pool = live
    seen = {}

    async def body(t):
        head = t.llm.prefill("You are terse. The mill wheel turns when water flows.\n", name="head")
        a = t.llm.generate("Say yes.", after=head, max_tokens=2, name="yes")
        b = t.llm.generate("Say no.", after=head, max_tokens=2, name="no")
        first = [await a, await b]
        top = t.rerank("What carries water to a mill wheel?", [BASALT, HEADRACE], top_n=1)
        vectors = t.embed([HEADRACE, BASALT])
        seen["top"], seen["shape"] = await top, tuple((await vectors).shape)
        for i in range(100):  # cancelled long before its end
            first.append(await t.llm.generate(f"Count to {i}.", max_tokens=4, name="count"))
        return {"answer": first}

    svc.workflows["live_traced"] = Workflow("live_traced", "", {}, trace=body)

    async def go():
        r = await svc.prepare_off_loop("live_traced", {}, {})
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.execute, r)
            while not any(rec.node.startswith("count.") and rec.state == "done" for rec in r.records):
                await anyio.sleep(0.05)
            svc.cancel(r.id)
        return r

    try:
        r = portal.call(go)
    finally:
        del svc.workflows["live_traced"]
    assert r.status == "cancelled"
    # The reranker's own order of the two, asked directly in the same batch shape: the 135M model's scores
    # for these two are close, and llama.cpp's logits depend on how a batch shares its prompts' prefix.
    scores = portal.call(pool.resolve("smollm2-rerank").engine.score, "What carries water to a mill wheel?",
                         [BASALT, HEADRACE])
    assert seen["top"] == [[BASALT, HEADRACE][int(scores.argmax())]] and seen["shape"] == (2, 384)
    ops = {n: node.op for n, node in r.graph.nodes.items()}
    assert ops["head.1"] == Op.PARTIAL_PREFILL and ops["yes.2.prefill"] == ops["no.3.prefill"] == Op.FULL_PREFILL
    assert r.graph.parents("yes.2.prefill") == r.graph.parents("no.3.prefill") == ["head.1"]
    assert not any(rec.state == "running" for rec in r.records)
    engine = pool.resolve("smollm2").engine
    deadline = time.monotonic() + 10  # the engine's thread drops the aborted request on its next iteration
    while not idle(engine.stats()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(engine.stats())
