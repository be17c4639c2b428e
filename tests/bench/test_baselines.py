"""The client-side baselines of the benchmark harness, against a real server."""

from __future__ import annotations

import csv
import inspect
import json
import sys

import httpx
import pytest

from conftest import API_KEY
from headrace.bench.baselines import MissingPeer, require
from headrace.graph.ops import chunk_text
from headrace.graph.prompts import PromptTemplate
from headrace.graph.workflow import WorkflowInputError
from headrace.graph.workflows import common, rag, summary

LLM, EMBED, RERANK = "smollm2", "all-minilm-l6-v2", "smollm2-rerank"
DOCS = [inspect.getdoc(json), inspect.getdoc(csv)]
QUESTION = "Which module reads and writes comma separated values?"
DOCUMENT = " ".join(" ".join(DOCS).split()[:300])  # 3 chunks of 128 words: maps, a reduce and a chain of 3
SMALL = {"chunk_size": 64, "chunk_overlap": 8}  # short prompts: fast on a CPU


# Without a model ------------------------------------------------------------------------


def test_require_names_the_package_and_the_extra():
    with pytest.raises(MissingPeer) as exc:
        require("headrace_no_such_peer", "no-such-peer", "the test baseline")
    message = str(exc.value)
    assert message.startswith("the test baseline needs no-such-peer (pip install 'headrace[bench]')")
    assert "headrace_no_such_peer" in message
    assert isinstance(exc.value.__cause__, ImportError)


def test_baselines_refuse_to_build_without_their_peer(monkeypatch):
    from headrace.bench.baselines import chaining, llamaindex

    monkeypatch.setitem(sys.modules, "llama_index.core", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "openai", None)
    llamaindex._lib.cache_clear()
    try:
        with pytest.raises(MissingPeer, match=r"the LlamaIndex baseline needs llama-index-core"):
            llamaindex.LlamaIndexRAG("http://x", "k", LLM, EMBED, RERANK)
        with pytest.raises(MissingPeer, match=r"the client-chaining baseline needs openai"):
            chaining.ClientChaining("http://x", "k", LLM)
    finally:
        llamaindex._lib.cache_clear()


def test_llamaindex_templates_render_headrace_prompts():
    from llama_index.core import PromptTemplate as LlamaPrompt

    from headrace.bench.baselines.llamaindex import ANSWER_TEMPLATE, EXPAND_TEMPLATE, REFINE_TEMPLATE, TEMPLATES

    v = {"question": "Why {braces}?", "context": "a {context_str} b", "previous": "before", "n_queries": "2"}
    answer = LlamaPrompt(ANSWER_TEMPLATE).partial_format(query_str=v["question"]).format(context_str=v["context"])
    assert answer == PromptTemplate(common.ANSWER).render(v)
    refine = (LlamaPrompt(REFINE_TEMPLATE).partial_format(query_str=v["question"], existing_answer="before")
              .format(context_msg=v["context"]))
    assert refine == PromptTemplate(common.REFINE).render(v)
    # The context-first order (the workflows' default), as common.STEPS[True] renders it.
    first_answer, first_refine = TEMPLATES[True]
    assert (LlamaPrompt(first_answer).partial_format(query_str=v["question"]).format(context_str=v["context"])
            == PromptTemplate(common.answer_context_first.prompt).render(v))
    assert (LlamaPrompt(first_refine).partial_format(query_str=v["question"], existing_answer="before")
            .format(context_msg=v["context"]) == PromptTemplate(common.refine_context_first.prompt).render(v))
    assert TEMPLATES[False] == (ANSWER_TEMPLATE, REFINE_TEMPLATE)
    # QueryFusionRetriever formats its prompt with str.format
    assert EXPAND_TEMPLATE.format(num_queries=2, query=v["question"]) == PromptTemplate(rag.EXPAND).render(v)


def test_baselines_validate_config_as_headrace_does():
    from headrace.bench.baselines import chaining, llamaindex

    _, config = llamaindex.validate("advanced_rag", {"question": "q", "documents": ["d"]}, {})
    assert config == {"chunk_size": 256, "chunk_overlap": 30, "max_tokens": 96, "n_queries": 3,
                      "k_per_query": 16, "top_n": 3, "synthesis": "refine", "context_first": True}  # placement unset
    with pytest.raises(ValueError, match="config.place_documents"):
        llamaindex.validate("advanced_rag", {"question": "q", "documents": ["d"]}, {"place_documents": True})
    with pytest.raises(ValueError, match="config.top_kk"):
        llamaindex.validate("naive_rag", {"question": "q", "documents": ["d"]}, {"top_kk": 3})
    with pytest.raises(ValueError, match="implements 'tree' only"):
        llamaindex.validate("naive_rag", {"question": "q", "documents": ["d"]}, {"synthesis": "refine"})
    with pytest.raises(ValueError, match="server-side"):
        chaining.validate("chain_summary", {"document": "d"}, {"optimize": {"passes": []}})
    with pytest.raises(ValueError, match="runs"):
        chaining.validate("naive_rag", {"question": "q", "documents": ["d"]}, {})


# Against the daemon -----------------------------------------------------------------------


class Recorder:
    """An httpx client that keeps every request body and response status."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, int]] = []
        self.client = httpx.AsyncClient(timeout=120, event_hooks={"response": [self._record]})

    async def _record(self, response: httpx.Response) -> None:
        await response.aread()
        body = json.loads(response.request.content or b"{}")
        self.calls.append((response.request.url.path, body, response.status_code))

    def chats(self) -> list[dict]:
        return [body for path, body, _ in self.calls if path.endswith("/chat/completions")]


@pytest.fixture
def no_tiktoken(monkeypatch):
    """Any attempt to load tiktoken (LlamaIndex's default tokenizer, a download) fails the test."""
    import tiktoken

    def refuse(*args, **kwargs):
        raise AssertionError("the baseline loaded tiktoken")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    monkeypatch.setattr(tiktoken, "encoding_for_model", refuse)


@pytest.mark.slow
@pytest.mark.anyio
async def test_llamaindex_naive_rag_is_headrace_tree_synthesis(server, no_tiktoken):
    from headrace.bench.baselines.llamaindex import LlamaIndexRAG

    rec = Recorder()
    rag_ = LlamaIndexRAG(server.base_url, API_KEY, LLM, EMBED, RERANK, http_client=rec.client)
    try:
        out = await rag_.run("naive_rag", {"question": QUESTION, "documents": DOCS}, {"max_tokens": 8, **SMALL})
    finally:
        await rag_.aclose()
        await rec.client.aclose()
    assert isinstance(out["answer"], str) and out["answer"].strip()
    assert all(status == 200 for _, _, status in rec.calls), rec.calls
    chats = rec.chats()
    assert len(chats) == 4  # top_k 3 leaves, then one combine call
    chunks = chunk_text(DOCS, SMALL["chunk_size"], SMALL["chunk_overlap"])
    for body in chats:
        assert body["model"] == LLM and body["temperature"] == 0 and body["max_tokens"] == 8
        assert [m["role"] for m in body["messages"]] == ["user"]
    leaves = {body["messages"][0]["content"] for body in chats[:3]}  # one answer call per retrieved chunk
    assert len(leaves) == 3
    # In the workflows' default order: the context first (common.STEPS[True]).
    template = PromptTemplate(common.answer_context_first.prompt)
    assert leaves <= {template.render({"question": QUESTION, "context": c}) for c in chunks}
    combine = chats[3]["messages"][0]["content"]
    assert "Answer 1: " in combine and "Answer 3: " in combine
    from llama_index.core import Settings  # objects were passed explicitly: no global defaults were made

    assert (Settings._llm, Settings._embed_model, Settings._node_parser, Settings._tokenizer) == (None,) * 4


@pytest.mark.slow
@pytest.mark.anyio
async def test_llamaindex_advanced_rag_expands_reranks_and_refines(server, no_tiktoken):
    from headrace.bench.baselines.llamaindex import LlamaIndexRAG

    rec = Recorder()
    rag_ = LlamaIndexRAG(server.base_url, API_KEY, LLM, EMBED, RERANK, http_client=rec.client)
    try:
        out = await rag_.run("advanced_rag", {"question": QUESTION, "documents": DOCS},
                             {"max_tokens": 8, "n_queries": 2, "k_per_query": 2, **SMALL})
    finally:
        await rag_.aclose()
        await rec.client.aclose()
    assert isinstance(out["answer"], str) and out["answer"].strip()
    assert all(status == 200 for _, _, status in rec.calls), rec.calls
    chats = rec.chats()
    expand = chats[0]
    assert expand["max_tokens"] == 32
    assert expand["messages"][0]["content"] == PromptTemplate(rag.EXPAND).render(
        {"question": QUESTION, "n_queries": "2"})
    reranks = [body for path, body, _ in rec.calls if path.endswith("/rerank")]
    assert len(reranks) == 1 and reranks[0]["top_n"] == 3 and reranks[0]["model"] == RERANK
    assert 2 <= len(reranks[0]["documents"]) <= 2 * 3  # k_per_query for the question and each query, deduplicated
    synth = [body["messages"][0]["content"] for body in chats[1:]]
    assert synth[0].startswith("Answer the question using the context.")
    assert all(p.startswith("Refine the answer") for p in synth[1:]) and len(synth) >= 2


@pytest.mark.slow
@pytest.mark.anyio
async def test_client_chaining_summaries(server):
    from headrace.bench.baselines.chaining import ClientChaining

    rec = Recorder()
    chain = ClientChaining(server.base_url, API_KEY, LLM, http_client=rec.client)
    config = {"chunk_size": 128, "max_tokens": 8}
    n = len(chunk_text(DOCUMENT, 128, 0))
    try:
        mr = await chain.run("map_reduce_summary", {"document": DOCUMENT}, config)
        assert len(rec.chats()) == n + 1  # the maps, then one reduce (n <= fan_in 8)
        ch = await chain.run("chain_summary", {"document": DOCUMENT}, config)
        assert len(rec.chats()) == 2 * n + 1
    finally:
        await chain.aclose()
        await rec.client.aclose()
    assert isinstance(mr["summary"], str) and mr["summary"].strip()
    assert isinstance(ch["summary"], str) and ch["summary"].strip()
    assert all(status == 200 for _, _, status in rec.calls), rec.calls
    prompts = [body["messages"][0]["content"] for body in rec.chats()]
    chunks = chunk_text(DOCUMENT, 128, 0)
    assert sorted(prompts[:n]) == sorted(PromptTemplate(summary.MAP).render({"chunk": c}) for c in chunks)
    assert prompts[n].startswith(summary.REDUCE_HEAD) and f"Part {n}: " in prompts[n]
    assert prompts[n + 1] == PromptTemplate(summary.FIRST).render({"chunk": chunks[0]})
    assert prompts[n + 2].startswith("Here is a summary of a document so far")


def test_semantic_calls_render_the_workflows_prompts():
    from headrace.bench.baselines.semantic import renamed

    text = "Water flows down the headrace."
    names = {"chunk": "chunk_3", "summary": "map_3"}
    assert PromptTemplate(renamed(summary.MAP, names)).render({"chunk_3": text}) == \
        PromptTemplate(summary.MAP).render({"chunk": text})
    names = {"previous": "step_1", "chunk": "chunk_2", "summary": "step_2"}
    update = PromptTemplate(renamed(summary.UPDATE, names))
    assert update.inputs == ("step_1", "chunk_2") and update.output == "step_2"


@pytest.mark.slow
@pytest.mark.anyio
async def test_semantic_calls_summaries(server):
    from headrace.bench.baselines.semantic import SemanticCalls

    config = {"chunk_size": 128, "max_tokens": 8}
    async with SemanticCalls(server.base_url, API_KEY, LLM) as semantic:
        mr = await semantic.run("map_reduce_summary", {"document": DOCUMENT}, config)
        ch = await semantic.run("chain_summary", {"document": DOCUMENT}, config)
    assert isinstance(mr["summary"], str) and mr["summary"].strip()
    assert isinstance(ch["summary"], str) and ch["summary"].strip()


def test_client_loops_validate_as_headrace_does():
    from headrace.bench.baselines import dynamic_clients

    inputs, config = dynamic_clients.validate("debate", {"question": "q"}, {"agents": 2})
    assert config == {"agents": 2, "rounds": 3, "max_tokens": 48}
    with pytest.raises(WorkflowInputError, match="config.agents"):
        dynamic_clients.validate("debate", {"question": "q"}, {"agents": 0})
    with pytest.raises(ValueError, match="server-side setting"):
        dynamic_clients.validate("agent", {"question": "q"}, {"isolate": True})
    with pytest.raises(ValueError, match="no search"):
        dynamic_clients.validate("agent", {"question": "q", "collection": "c"}, {})
    # The text a client sends is the text the traced call prefills.
    assert dynamic_clients.render("Q: {{input:q}}\nAnswer:", {"q": "why?"}) == "Q: why?\nAnswer:"
