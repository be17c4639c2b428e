"""The summary and search built-in workflows: graph shapes, input errors, and end-to-end runs.

The end-to-end tests (``slow``) run each workflow in-process on the default
config's real engines (SmolLM2-135M on the CPU, MiniLM, LanceDB), with short
documents from the standard library's docstrings and small token budgets.
"""

from __future__ import annotations

import inspect
import json
import statistics
from pathlib import Path

import pytest

from headrace.graph.graph import Op
from headrace.graph.service import WorkflowService
from headrace.graph.workflow import WorkflowInputError
from headrace.graph.workflows.search import CONTEXTUAL, SEARCH_GEN, join_contexts, parse_judgement
from headrace.graph.workflows.summary import CHAIN, MAP_REDUCE

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {"llm": "smollm2", "embed": "all-minilm-l6-v2", "vector_store": "lancedb", "rerank": "smollm2-rerank"}

STATS_DOC = inspect.getdoc(statistics)  # ~400 words
JSON_DOC = inspect.getdoc(json)  # ~320 words
CORPUS = [inspect.getdoc(m) for m in (json, statistics, inspect)]


def words(text: str) -> int:
    return len(text.split())


# offline: schemas, graph shapes, errors ---------------------------------------------------


def offline_service(registry) -> WorkflowService:
    def resolve(name):  # no engine is loaded: prepare skips the checks that need one
        raise LookupError("an offline test must not run a primitive")

    return WorkflowService(registry.workflows, registry.passes, resolve, lambda: dict(ENGINES))


def test_registered(registry):
    for wf in (MAP_REDUCE, CHAIN, SEARCH_GEN, CONTEXTUAL):
        assert registry.workflows[wf.name] is wf
        schema = wf.schema()
        json.dumps(schema)  # the schema is served over REST
        assert set(schema["inputs"]["required"]) == set(wf.required)


def test_map_reduce_shape():
    inputs, config = MAP_REDUCE.validate({"document": STATS_DOC}, {"chunk_size": 32, "fan_in": 4})
    g = MAP_REDUCE.build(inputs, config, ENGINES)
    n = -(-words(STATS_DOC) // 32)
    maps = sorted(i for i, node in g.nodes.items() if i.startswith("map_") and node.op == Op.DECODE)
    assert len(maps) == n > 8
    # fan_in 4: ceil(n / 4) first-level reduces, then more levels until the one "reduce" writes "summary"
    assert len([i for i in g.nodes if i.startswith("reduce_0_") and g.nodes[i].op == Op.DECODE]) == -(-n // 4)
    assert g.nodes["reduce"].outputs == ("summary",) and g.nodes["reduce"].depth == 0
    assert all(g.nodes[m].params["max_tokens"] == 64 for m in maps)
    g.topo_order()  # acyclic
    # one chunk only: a single map writes the summary, no reduce
    inputs, config = MAP_REDUCE.validate({"document": "a short text"}, {})
    g = MAP_REDUCE.build(inputs, config, ENGINES)
    assert g.nodes["map_0"].outputs == ("summary",) and "reduce" not in g.nodes


def test_chain_shape():
    inputs, config = CHAIN.validate({"document": STATS_DOC}, {"chunk_size": 100})
    g = CHAIN.build(inputs, config, ENGINES)
    steps = [f"step_{i}" for i in range(-(-words(STATS_DOC) // 100))]
    for prev, step in zip(steps, steps[1:]):
        assert prev in g.descendants("chunk") and step in g.descendants(prev)
    assert g.nodes[steps[-1]].outputs == ("summary",)


def test_search_gen_shape():
    inputs, config = SEARCH_GEN.validate({"question": "q", "corpus": CORPUS}, {})
    g = SEARCH_GEN.build(inputs, config, ENGINES)
    assert g.branches == {"route": {"search": ["search"]}}
    assert g.nodes["search"].op == Op.TEXT_SEARCH and g.nodes["search"].params["default"] == ""
    assert "search" in g.children("route")  # a data edge (the branch label), so pruning keeps it
    assert {"ingest", "route"} <= set(g.parents("search"))
    assert {"proxy", "search"} <= set(g.parents("answer.prefill"))  # draft and evidence
    assert inputs["search_mode"] == "auto"


def test_contextual_shape():
    inputs, config = CONTEXTUAL.validate({"question": "q", "documents": CORPUS}, {"chunk_size": 64})
    g = CONTEXTUAL.build(inputs, config, ENGINES)
    contexts = sorted(i for i, n in g.nodes.items() if n.component == "context" and n.op == Op.DECODE)
    n = sum(-(-words(d) // 64) for d in CORPUS)
    assert len(contexts) == n
    assert set(contexts) <= set(g.parents("contextualize"))
    assert g.nodes["context_0.prefill"].inputs == ("chunk_none", "chunk_0", "chunk_1")
    assert g.nodes["search"].params["k"] == 32 and g.nodes["rerank"].params["top_n"] == 3
    assert join_contexts(["text a", "text b"], "ctx a", " ") == ["ctx a\ntext a", "text b"]


@pytest.mark.parametrize("reply, branch", [
    ("Yes", "search"), (" yes.", "search"), ("YES, it is", "search"), ("Not sure; yes", "search"),
    ("No", "direct"), ("no, yes", "direct"), ("", "direct"), ("maybe", "direct"), (None, "direct"),
    ("yesterday", "direct"),
])
def test_parse_judgement(reply, branch):
    assert parse_judgement(reply) == branch


@pytest.mark.parametrize("name, inputs, config, field", [
    ("map_reduce_summary", {}, {}, "inputs.document"),
    ("map_reduce_summary", {"document": ""}, {}, "inputs.document"),
    ("map_reduce_summary", {"document": 3}, {}, "inputs.document"),
    ("map_reduce_summary", {"document": "   "}, {}, "inputs.document"),
    ("map_reduce_summary", {"document": "x"}, {"fan_in": 1}, "config.fan_in"),
    ("map_reduce_summary", {"document": "x"}, {"chunk_size": 64, "chunk_overlap": 64}, "config.chunk_overlap"),
    ("map_reduce_summary", {"document": "x", "documents": ["x"]}, {}, "inputs.documents"),
    ("chain_summary", {"document": ["a list"]}, {}, "inputs.document"),
    ("chain_summary", {"document": "x"}, {"max_tokens": 0}, "config.max_tokens"),
    ("search_gen", {"question": "q"}, {}, "inputs.corpus"),
    ("search_gen", {"question": "q", "corpus": []}, {}, "inputs.corpus"),
    ("search_gen", {"question": "q", "corpus": ["ok", ""]}, {}, "inputs.corpus[1]"),
    ("search_gen", {"corpus": ["x"]}, {}, "inputs.question"),
    ("search_gen", {"question": "q", "corpus": ["x"]}, {"search": "maybe"}, "config.search"),
    ("search_gen", {"question": "q", "corpus": ["x"]}, {"k": 0}, "config.k"),
    ("contextual_retrieval", {"question": "q"}, {}, "inputs.documents"),
    ("contextual_retrieval", {"question": "", "documents": ["x"]}, {}, "inputs.question"),
    ("contextual_retrieval", {"question": "q", "documents": ["x"]}, {"top_n": "3"}, "config.top_n"),
    ("contextual_retrieval", {"question": "q", "documents": ["x"]}, {"rerank_from": 0}, "config.rerank_from"),
])
def test_bad_inputs(registry, name, inputs, config, field):
    with pytest.raises(WorkflowInputError) as err:
        offline_service(registry).prepare(name, inputs, config)
    assert err.value.field == field


# end to end on the real engines ----------------------------------------------------------


def records(run, op: str | None = None, prefix: str = "") -> dict:
    """The run's node records by node id (top-level scope), optionally one op's, ids starting with prefix."""
    return {r.node: r for r in run.records if (op is None or r.op == op) and r.node.startswith(prefix)}


def span(run, prefix: str, op: str) -> tuple[float, float]:
    """When the first of a node's stages (``prefix``, ``prefix#1``, ...) started and the last finished."""
    stages = [r for node, r in records(run, op, prefix).items() if node == prefix or node.startswith(f"{prefix}#")]
    assert stages, f"no {op} node {prefix!r}"
    return min(r.started for r in stages), max(r.finished for r in stages)


def check_ok(run, output: str) -> str:
    assert run.status == "succeeded", run.error
    text = run.result[output]
    assert isinstance(text, str) and text.strip(), run.result
    return text


@pytest.mark.slow
def test_map_reduce_summary_live(live):
    portal, svc, _ = live
    run = portal.call(svc.run, "map_reduce_summary", {"document": STATS_DOC},
                      {"chunk_size": 100, "max_tokens": 24})
    check_ok(run, "summary")
    maps = records(run, "decode", "map_")
    assert len(maps) == -(-words(STATS_DOC) // 100) >= 4
    assert all(r.state == "done" for r in maps.values())
    # independent: every map was decoding at once (the LLM engine batched them)
    assert max(r.started for r in maps.values()) < min(r.finished for r in maps.values())
    reduce = records(run, "decode", "reduce")
    assert list(reduce) == ["reduce"]
    assert reduce["reduce"].started >= max(r.finished for r in maps.values())


@pytest.mark.slow
def test_chain_summary_live(live):
    portal, svc, _ = live
    run = portal.call(svc.run, "chain_summary", {"document": JSON_DOC}, {"chunk_size": 128, "max_tokens": 24})
    check_ok(run, "summary")
    steps = records(run, "decode", "step_")
    n = -(-words(JSON_DOC) // 128)
    assert sorted(steps) == [f"step_{i}" for i in range(n)] and n >= 3
    order = [steps[f"step_{i}"] for i in range(n)]
    for prev, step in zip(order, order[1:]):
        assert step.started >= prev.finished  # strictly one after another
    prefills = records(run, None, "step_")
    for i in range(1, n):  # the step's (full) prefill also waits for the previous summary
        full = prefills[f"step_{i}.prefill"]
        assert full.started >= order[i - 1].finished


def search_run(live, question: str, mode: str, passes: list[str] | None = None):
    """Run search_gen and capture the judge's reply and the branch taken (spying on the decide function)."""
    portal, svc, _ = live
    config = {"search": mode, "max_tokens": 24, "k": 2}
    if passes is not None:
        config["optimize"] = {"passes": passes}
    # A Run holds a cancel scope, so it is made on the event loop.
    run = portal.call(svc.prepare, "search_gen", {"question": question, "corpus": CORPUS}, config)
    seen = {}
    decide = run.graph.nodes["decide"].params["fn"]

    def spy(judgement, search_mode):
        seen["judgement"], seen["decision"] = judgement, decide(judgement, search_mode)
        return seen["decision"]

    run.graph.nodes["decide"].params["fn"] = spy  # this run's copy of the e-graph only
    portal.call(svc.execute, run)
    check_ok(run, "answer")
    return run, seen


@pytest.mark.slow
def test_search_gen_judge_decides(live):
    # SmolLM2's judge answers "Yes" here (greedy); whatever it says, the branch must follow its reply.
    run, seen = search_run(live, "What does the json module's dumps function return?", "auto")
    assert isinstance(seen["judgement"], str)
    assert seen["decision"] == parse_judgement(seen["judgement"])
    expected = "done" if seen["decision"] == "search" else "skipped"
    assert records(run)["search"].state == expected, seen


@pytest.mark.slow
def test_search_gen_search_branch(live):
    # config.search = "always" overrides the judge (which says "No" to this one)
    run, seen = search_run(live, "Which statistics function computes the median of a data set?", "always")
    assert seen["decision"] == "search"
    recs = records(run)
    assert recs["search"].state == "done" and recs["search"].op == "text_search"
    assert recs["search"].started >= recs["route"].finished >= recs["judge"].finished
    assert recs["search"].started >= recs["ingest"].finished
    assert recs["answer"].started >= recs["search"].finished


@pytest.mark.slow
@pytest.mark.parametrize("passes", [None, []], ids=["optimized", "no-passes"])
def test_search_gen_direct_branch(live, passes):
    run, seen = search_run(live, "What is two plus two?", "never", passes)
    assert seen["decision"] == "direct"
    recs = records(run)
    assert recs["search"].state == "skipped"
    assert recs["judge"].state == "done" and recs["answer"].state == "done"
    assert recs["answer"].started >= recs["route"].finished


@pytest.mark.slow
def test_contextual_retrieval_live(live):
    portal, svc, _ = live
    docs = [JSON_DOC, inspect.getdoc(statistics.median)]
    run = portal.call(svc.run, "contextual_retrieval", {"question": "How do I decode a JSON document?",
                                                        "documents": docs},
                      {"chunk_size": 96, "context_tokens": 16, "max_tokens": 24, "rerank_from": 6, "top_n": 2})
    check_ok(run, "answer")
    n = sum(-(-words(d) // 96) for d in docs)
    contexts = records(run, "decode", "context_")
    assert len(contexts) == n >= 4 and all(r.state == "done" for r in contexts.values())
    # the context calls ran together (batched), all before the contextualized chunks were embedded
    assert max(r.started for r in contexts.values()) < min(r.finished for r in contexts.values())
    embeds = records(run, "embed", "embed_contextual")
    assert embeds and min(r.started for r in embeds.values()) >= max(r.finished for r in contexts.values())
    recs = records(run)
    # The rerank may run in stages (stage decomposition at the reranker's max_efficient_batch_size).
    rerank_started, rerank_finished = span(run, "rerank", "rerank")
    assert rerank_started >= recs["search"].finished >= recs["ingest"].finished
    assert recs["answer"].started >= rerank_finished
