"""Chunks prefilled at ingest (issue 49): a collection's chunks are prefilled behind the RAG workflows' chunk-first
prompts when they are ingested, so the first query over a fresh collection already finds its chunks cached
(counted by ``headrace_prompt_cached_tokens_total``, not timed); only the ingesting key's partition holds them;
``chunk_kv: false`` turns it off.

The session daemon (``server``): the default config, two API keys kept apart. Each test's documents are its own
(a fresh topic), so nothing another test sent is cached."""

from __future__ import annotations

import uuid

import httpx
import pytest

from conftest import API_KEY, OTHER_API_KEY, metric_value
from headrace.graph.chunk_kv import CHUNK_FIRST_STEPS, chunk_prompts

pytestmark = pytest.mark.slow

LLM = "smollm2"
BLOCK = 16  # the prefix cache's block: a hit is a whole number of them


def documents(topic: str) -> list[str]:
    """Two documents of one chunk each (~150 tokens), about ``topic``."""
    return [" ".join(f"The {topic} gate number {i} lets water into the {side} channel at dawn." for i in range(12))
            for side in ("left", "right")]


def post(server, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)


def collection(server, key: str, texts: list[str], **settings) -> dict:
    name = f"kv-{uuid.uuid4().hex[:10]}"
    r = post(server, key, "/v1/collections", {"name": name, **settings})
    assert r.status_code == 200, r.text
    assert r.json()["chunk_kv"] is settings.get("chunk_kv", True)
    r = post(server, key, f"/v1/collections/{name}/documents", {"documents": [{"text": t} for t in texts]})
    assert r.status_code == 200, r.text
    return {"name": name, **r.json()}


def cached_tokens(server) -> float:
    return metric_value(server.metrics(), "headrace_prompt_cached_tokens_total", model=LLM)


def run_cached(server, key: str, name: str, question: str) -> float:
    """The prompt tokens naive_rag's tree (a leaf per chunk, then the combine) found cached, over both chunks."""
    before = cached_tokens(server)
    r = post(server, key, "/v1/workflows/naive_rag/runs", {
        "inputs": {"question": question, "collection": name}, "config": {"top_k": 2, "max_tokens": 2}})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "succeeded", r.text
    return cached_tokens(server) - before


def chunk_tokens(server, texts: list[str]) -> list[int]:
    """Each chunk's tokens in its leaf prompt, past the chat head and instruction."""
    engine = server.app.state.services.daemon.pool.resolve(LLM).engine
    return [len(chunk_prompts(engine, t)[0]) - len(chunk_prompts(engine, "")[0]) for t in texts]


def test_the_first_query_over_a_fresh_collection_finds_its_chunks_cached(server):
    texts = documents(f"sluice {uuid.uuid4().hex[:6]}")
    made = collection(server, API_KEY, texts)
    assert made["chunks"] == 2
    kv = made["chunk_kv"]
    assert kv["model"] == LLM and kv["prompts"] == 2 * len(CHUNK_FIRST_STEPS), kv
    cached = run_cached(server, API_KEY, made["name"], "Which gates let water in?")
    # Each leaf restores its chunk, short of the block its last tokens share with the question at most.
    assert cached >= sum(n - 2 * BLOCK for n in chunk_tokens(server, texts)), (cached, chunk_tokens(server, texts))


def test_chunks_prefilled_for_one_key_are_not_found_by_another(server):
    texts = documents(f"weir {uuid.uuid4().hex[:6]}")
    mine = collection(server, API_KEY, texts)  # the same chunks, prefilled in the first key's partition
    theirs = collection(server, OTHER_API_KEY, texts, chunk_kv=False)
    assert "chunk_kv" not in theirs
    least = min(chunk_tokens(server, texts))
    # At most the chat head and instruction (a block or two, cached by the key's earlier prompts) per prompt.
    assert run_cached(server, OTHER_API_KEY, theirs["name"], "Which gates let water in?") < least
    # They were there: the key that ingested them finds them.
    assert run_cached(server, API_KEY, mine["name"], "Which gates let water in?") >= 2 * (least - 2 * BLOCK)


def test_the_first_rerank_over_a_fresh_collection_finds_its_chunks_cached(server):
    """The default reranker reads the document first and scores through the LLM's prefix cache: the ingest scores
    each chunk once ahead, so the first rerank of it restores it, in the ingesting key's partition only."""
    texts = documents(f"flume {uuid.uuid4().hex[:6]}")
    made = collection(server, API_KEY, texts)
    judged = made["chunk_kv"]["rerank"]
    assert judged["engine"] == "smollm2-rerank" and judged["documents"] == 2, judged

    def reranked(key: str) -> float:
        before = cached_tokens(server)
        r = post(server, key, "/v1/rerank", {"model": "smollm2-rerank", "query": "Which gate opens at dawn?",
                                              "documents": texts})
        assert r.status_code == 200, r.text
        return cached_tokens(server) - before

    assert reranked(OTHER_API_KEY) < 2 * 64  # at most the judge's system prompt a prompt, from its own scoring
    assert reranked(API_KEY) > 2 * 150  # both chunks (~190 tokens each), restored
