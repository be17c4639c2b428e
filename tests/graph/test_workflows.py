"""naive_rag, advanced_rag and fact_verify end to end on the real models; streaming, cancel and failure."""

from __future__ import annotations

import time

import anyio
import pytest

from conftest import idle
from headrace.batching.meta import PrimitiveMeta
from headrace.graph.events import RunEvents
from headrace.graph.graph import Op
from headrace.graph.remaining import RemainingWork

pytestmark = pytest.mark.slow

DOCS = [
    "A headrace is the channel that carries water from a river or pond to a water wheel. The water then "
    "turns the wheel, which drives the mill's machinery.",
    "The tailrace carries the water away from the wheel after it has done its work, back to the river.",
    "Paris is the capital and largest city of France. The Eiffel Tower stands in Paris.",
]
QUESTION = "What does a headrace carry?"


def by_node(run) -> dict:
    out: dict = {}
    for r in run.records:
        out.setdefault(r.node, []).append(r)
    return out


def test_naive_rag_tree(live, monkeypatch):
    portal, svc, _ = live
    # Learned from this run alone: the table keeps each node's shortest over every naive_rag the shared
    # daemon ran before, so with other runs (other documents, other tests) its order need not be this run's.
    monkeypatch.setattr(svc.executor, "remaining", RemainingWork())
    run = portal.call(svc.run, "naive_rag", {"question": QUESTION, "documents": DOCS}, {"max_tokens": 24})
    assert run.status == "succeeded", run.error
    assert run.result["answer"].strip()
    nodes = by_node(run)
    # tree synthesis over 3 contexts: 3 leaves and a root that starts after all of them
    leaves = [nodes[f"answer_{i}"][0] for i in range(3)]
    root = nodes["combine_0_0"][0]
    assert root.started >= max(r.finished for r in leaves)
    # dependency pruning: the question's embed does not wait for indexing
    assert nodes["embed_question"][0].started < nodes["ingest"][0].finished
    # prefill split: each leaf's instruction and question were prefilled before retrieval finished
    assert nodes["answer_0.prefill.partial"][0].started < nodes["search"][0].finished
    # What the deadline policy learns from it: from each node's start to the run's end, never more than the run
    left = svc.executor.remaining.of("naive_rag")
    assert set(left) >= {"embed_question", "search", "combine_0_0"}
    assert 0 < left["combine_0_0"] < left["search"] < left["embed_question"] <= run.finished - run.started


def test_advanced_rag_streams_expansion_into_embeds(live):
    portal, svc, _ = live
    run = portal.call(svc.run, "advanced_rag", {"question": QUESTION, "documents": DOCS},
                      {"max_tokens": 24, "n_queries": 3})
    assert run.status == "succeeded", run.error
    nodes = by_node(run)
    expand = nodes["expand"][0]
    assert expand.op == "partial_decode"
    embeds = sorted(nodes.get("embed_queries", []), key=lambda r: r.started)
    assert embeds, "the expansion yielded no query"
    # Streaming, by timestamps: the first downstream embed starts before the expansion decode ends.
    assert embeds[0].started < expand.finished
    assert [r.key for r in embeds] == [(i,) for i in range(len(embeds))]
    assert run.result["answer"].strip()


def test_advanced_rag_without_passes_is_a_module_chain(live):
    portal, svc, _ = live
    run = portal.call(svc.run, "advanced_rag", {"question": QUESTION, "documents": DOCS},
                      {"max_tokens": 16, "optimize": {"passes": []}})
    assert run.status == "succeeded", run.error
    nodes = by_node(run)
    assert nodes["expand"][0].op == "decode"
    # no pipelining: one embed of every query, after the whole expansion
    assert len(nodes["embed_queries"]) == 1
    assert nodes["embed_queries"][0].started >= nodes["expand"][0].finished
    # no pruning: each component waits for the one before it
    assert nodes["expand.prefill"][0].started >= nodes["ingest"][0].finished


def test_fact_verify_reports_a_verdict_per_claim(live):
    portal, svc, _ = live
    run = portal.call(svc.run, "fact_verify", {"question": "What is the capital of France?", "documents": DOCS},
                      {"max_tokens": 24, "max_claims": 2})
    assert run.status == "succeeded", run.error
    report = run.result["report"]
    assert report and all(set(item) == {"claim", "verdict", "supported"} for item in report)
    nodes = by_node(run)
    # nested keys: claim i -> query j
    assert all(len(r.key) == 2 for r in nodes["search"])
    assert len(nodes["verdict"]) == len(report)


def test_an_early_prefill_is_skipped_while_the_engine_serves_another_run(live):
    """The prefill split's early prefill only runs on an engine idle of other runs; skipped, the full
    prefills fill the whole prompt (tokenized whole, so the text may differ at the split's seam)."""
    portal, svc, pool = live
    sched = pool.resolve("smollm2").llm()
    inputs, config = {"question": QUESTION, "documents": DOCS}, {"max_tokens": 16}
    alone = portal.call(svc.run, "naive_rag", inputs, config)
    assert alone.status == "succeeded", alone.error

    async def beside_another_run():
        ctx = pool.slots["smollm2"].engine.new_context_id()
        other = PrimitiveMeta(run="another", node="held")
        await sched.prefill(ctx, pool.slots["smollm2"].engine.encode("The mill wheel turns."), None, other)
        try:
            return await svc.run("naive_rag", inputs, config)
        finally:
            await sched.free(ctx)

    busy = portal.call(beside_another_run)
    assert busy.status == "succeeded", busy.error
    early = [r for r in alone.records if r.op == "partial_prefill"]
    assert early and {r.state for r in early} == {"done"}
    skipped = [r for r in busy.records if r.op == "partial_prefill"]
    assert len(skipped) == len(early) and {r.state for r in skipped} == {"skipped"}
    assert busy.result["answer"].strip()


def test_a_reader_that_reads_nothing_until_the_run_ends_neither_pauses_nor_cancels_it(live):
    """The run publishes past a tiny event log while its one reader sleeps: the run succeeds, and the
    reader is told how many events it missed, then gets the newest ones, ending with the result."""
    portal, svc, pool = live

    async def run_beside_a_sleeping_reader():
        run = svc.prepare("naive_rag", {"question": QUESTION, "documents": DOCS}, {"max_tokens": 16})
        run.events = RunEvents(capacity=4)
        reader = run.events.follow()
        svc.start(run)
        with anyio.fail_after(300):
            await run.done.wait()
        async with reader:
            return run, [event async for event in reader]

    run, events = portal.call(run_beside_a_sleeping_reader)
    assert run.status == "succeeded", run.error
    assert events[0].name == "events.dropped" and events[0].body["missed"] > 0
    assert [e.seq for e in events[1:]] == list(range(events[0].body["resume"], events[-1].seq + 1))
    assert len(events) == 5 and events[-1].name == "run.finished"
    assert events[-1].body["result"] == run.result


def test_cancel_frees_contexts(live):
    portal, svc, pool = live
    llm = pool.slots["smollm2"].engine

    async def start_and_cancel():
        run = svc.prepare("advanced_rag", {"question": QUESTION, "documents": DOCS}, {"max_tokens": 200})
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.execute, run)
            while not any(r.node == "expand" for r in run.records):
                await anyio.sleep(0.01)
            svc.cancel(run.id)
        return run

    run = portal.call(start_and_cancel)
    assert run.status == "cancelled"
    assert not [r for r in run.records if r.state == "running"]
    deadline = time.monotonic() + 10
    while llm.stats()["contexts"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(llm.stats())


def test_failure_names_the_node_and_other_runs_go_on(live):
    portal, svc, _ = live

    async def two_runs():
        # The embed primitives pointed at the LLM engine (prepare refuses that as config, so the
        # built graph is edited): they fail at run time.
        bad = svc.prepare("naive_rag", {"question": QUESTION, "documents": DOCS}, {"max_tokens": 8})
        for node in bad.graph.nodes.values():
            if node.op == Op.EMBED:
                node.engine = "smollm2"
        good = svc.prepare("naive_rag", {"question": QUESTION, "documents": DOCS}, {"max_tokens": 8})
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc.execute, bad)
            tg.start_soon(svc.execute, good)
        return bad, good

    bad, good = portal.call(two_runs)
    assert bad.status == "failed" and "embed" in bad.error and "smollm2" in bad.error
    assert good.status == "succeeded", good.error


def test_engine_choices_are_checked_before_the_run(live):
    from headrace.graph.workflow import WorkflowInputError

    _, svc, _ = live
    inputs = {"question": QUESTION, "documents": DOCS}
    for engines, problem in (({"embed": "smollm2"}, "of kind 'llm', not 'embed'"), ({"llm": "nope"}, "no ready engine"),
                             ({"llm": 5}, "must be a string"), ({"gpu": "smollm2"}, "unknown field")):
        with pytest.raises(WorkflowInputError, match=problem) as err:
            svc.prepare("naive_rag", inputs, {"engines": engines})
        assert err.value.field == f"config.engines.{next(iter(engines))}"
    with pytest.raises(WorkflowInputError, match="does not fit the context") as err:
        svc.prepare("naive_rag", {**inputs, "question": "word " * 5000}, {})
    assert err.value.field == "inputs.question"
    with pytest.raises(WorkflowInputError, match="lone surrogate") as err:
        svc.prepare("naive_rag", {**inputs, "question": "a\ud800"}, {})
    assert err.value.field == "inputs.question"


def test_egraph_cache_hits_for_the_same_shape(live):
    portal, svc, _ = live
    before = svc.optimizer.stats.hits
    for question in ("What is a tailrace?", "What turns the wheel?"):
        run = portal.call(svc.prepare, "naive_rag", {"question": question, "documents": DOCS}, {"max_tokens": 8})
        svc.runs.pop(run.id)
    assert svc.optimizer.stats.hits >= before + 1


def test_run_may_override_the_batch_policy(live):
    portal, svc, _ = live
    run = portal.call(svc.run, "naive_rag", {"question": QUESTION, "documents": DOCS},
                      {"max_tokens": 8, "batch_policy": "topology"})
    assert run.status == "succeeded", run.error
    from headrace.graph.workflow import WorkflowInputError

    with pytest.raises(WorkflowInputError, match="unknown batch policy"):
        portal.call(svc.prepare, "naive_rag", {"question": QUESTION, "documents": DOCS}, {"batch_policy": "nope"})


def test_advanced_rag_with_a_split_rerank(live, registry):
    """Stage decomposition on the real engines: a rerank beyond its max efficient batch runs as stages."""
    from headrace.graph.service import WorkflowService

    portal, _, pool = live
    limits = {"smollm2-rerank": 4}
    svc = WorkflowService(registry.workflows, registry.passes, pool.resolve, pool.engines_by_kind, limits.get,
                          policies=[*registry.batch_policies, *registry.llm_policies])
    run = portal.call(svc.run, "advanced_rag", {"question": QUESTION, "documents": DOCS},
                      {"max_tokens": 16, "n_queries": 2, "k_per_query": 4, "top_n": 2})
    assert run.status == "succeeded", run.error
    nodes = by_node(run)
    assert "rerank" not in nodes
    stages = sorted(n for n in nodes if n.startswith("rerank#"))
    assert stages == [f"rerank#{i}" for i in range(3)]  # 4 * (2 + 1) candidates at most, 4 per stage
    # The synthesis reads the aggregate, which waits for every stage.
    agg = nodes["rerank.agg"][0]
    assert agg.started >= max(nodes[s][0].finished for s in stages)
    assert run.result["answer"].strip()
