"""Typed engine requests: how a batch of them becomes engine calls, and the graph's view of an engine."""

from __future__ import annotations

import anyio
import pytest
import torch

from headrace.batching.llm import LLMScheduler
from headrace.batching.meta import PrimitiveMeta
from headrace.batching.policies import FifoPolicy
from headrace.batching.resolved import ResolvedEngine
from headrace.batching.requests import (
    EmbedRequest,
    RerankRequest,
    VectorDrop,
    VectorIngest,
    VectorSearch,
    VectorSearchText,
    runner_for,
)
from headrace.batching.scheduler import BatchScheduler

from conftest import running

pytestmark = pytest.mark.anyio


class Lengths:
    """A real (tiny) embed engine: a text's vector is [its length]; records each call."""

    name, kind, dimensions = "lengths", "embed", 1

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def embed(self, texts):
        self.calls.append(list(texts))
        return torch.tensor([[float(len(t))] for t in texts])


class SharedLetters:
    """A real (tiny) reranker: a document scores the letters it shares with the query."""

    name, kind = "shared", "rerank"

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str]]] = []

    async def score_pairs(self, pairs, metas=()):
        self.calls.append(list(pairs))
        return torch.tensor([float(len(set(q) & set(d))) for q, d in pairs])


async def queued_together(sched: BatchScheduler, requests: list) -> list:
    """Submit ``requests`` so they share the scheduler's first batch; their results or errors, in order."""
    results: list = [None] * len(requests)

    async def one(i, request):
        try:
            results[i] = await sched.submit(request, 1, PrimitiveMeta(run="r", node=f"n{i}"))
        except Exception as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        async with anyio.create_task_group() as clients:
            for i, request in enumerate(requests):
                clients.start_soon(one, i, request)
                await anyio.wait_all_tasks_blocked()
            await tg.start(sched.run)
        tg.cancel_scope.cancel()
    return results


def scheduler(engine) -> BatchScheduler:
    return BatchScheduler(engine.name, runner_for(engine), FifoPolicy(), max_batch_size=64, max_wait_ms=0)


async def test_embeds_of_several_requests_are_one_engine_call_and_each_gets_its_rows():
    engine = Lengths()
    results = await queued_together(scheduler(engine), [EmbedRequest(("a", "bb")), EmbedRequest(("ccc",))])
    assert engine.calls == [["a", "bb", "ccc"]]
    assert [r.flatten().tolist() for r in results] == [[1.0, 2.0], [3.0]]


async def test_reranks_of_several_queries_are_one_engine_call_and_each_gets_its_scores():
    engine = SharedLetters()
    results = await queued_together(scheduler(engine), [RerankRequest("ab", ("abc", "x")), RerankRequest("xy", ("y",))])
    assert engine.calls == [[("ab", "abc"), ("ab", "x"), ("xy", "y")]]
    assert [r.tolist() for r in results] == [[2.0, 0.0], [1.0]]


async def test_reranks_of_several_cache_partitions_are_one_engine_call_each():
    """A reranker scoring through an LLM's prefix cache reuses only its own partition's KV: one call per partition
    (issue 50), each request's scores back in its place."""
    engine = SharedLetters()
    a, b = (PrimitiveMeta(run=r, node="rerank", cache_partition=r * 32) for r in "ab")
    results = await queued_together(scheduler(engine), [RerankRequest("ab", ("abc",), a), RerankRequest("xy", ("y",), b),
                                                        RerankRequest("ab", ("x", "b"), a)])
    assert engine.calls == [[("ab", "abc"), ("ab", "x"), ("ab", "b")], [("xy", "y")]]
    assert [r.tolist() for r in results] == [[2.0], [1.0], [0.0, 1.0]]


async def test_a_request_for_another_kind_of_engine_fails_alone_with_a_clear_error():
    engine = Lengths()
    results = await queued_together(scheduler(engine), [EmbedRequest(("a",)), VectorDrop("t"), EmbedRequest(("bb",))])
    assert isinstance(results[1], TypeError) and "cannot serve a VectorDrop" in str(results[1])
    assert [results[0].flatten().tolist(), results[2].flatten().tolist()] == [[1.0], [2.0]]


async def test_vector_store_requests_run_in_order_on_lancedb(tmp_path):
    from headrace.plugins.engines.retrieval import lancedb_store
    from headrace.plugins.protocols import EngineEnv, EngineSpec

    env = EngineEnv(data_dir=tmp_path, cache_dir=tmp_path, lookup=lambda name: None)
    store = lancedb_store.factory(EngineSpec(name="vs", plugin="lancedb"), env)
    payloads = ({"text": "red apples"}, {"text": "green pears"})
    async with running(store):
        ingested, near, by_text, dropped = await queued_together(scheduler(store), [
            VectorIngest("fruit", torch.eye(2), payloads),
            VectorSearch("fruit", torch.tensor([[0.0, 1.0]]), 1),
            VectorSearchText("fruit", "apples", 1),
            VectorDrop("fruit"),
        ])
    assert len(ingested) == 2
    assert [h.payload["text"] for h in near[0]] == ["green pears"]
    assert [h.payload["text"] for h in by_text] == ["red apples"]
    assert dropped is None and not list((tmp_path / "lancedb").glob("fruit*"))


async def test_a_resolved_engine_names_its_scheduler_kind():
    embed = Lengths()
    batch = ResolvedEngine(embed, scheduler(embed))
    assert batch.batch() is batch.scheduler
    with pytest.raises(TypeError, match="'lengths' is not an LLM"):
        batch.llm()

    class Silent:
        name, kind = "silent", "llm"

    llm = ResolvedEngine(Silent(), LLMScheduler(Silent(), max_running=1))
    assert llm.llm() is llm.scheduler
    with pytest.raises(TypeError, match="'silent' is not batch-scheduled"):
        llm.batch()
