"""Zero-copy handoff between co-hosted engines: the embedder's output is the memory the store reads."""

from __future__ import annotations

import anyio
import pytest
import torch

from headrace.batching.policies import FifoPolicy
from headrace.batching.requests import EmbedRequest, VectorIngest, VectorSearch, runner_for
from headrace.batching.scheduler import BatchScheduler
from headrace.plugins.engines.retrieval import lancedb_store
from headrace.plugins.engines.retrieval import st_embed
from headrace.plugins.engines.retrieval.handoff import HandoffStats, arrow_vectors, float32_rows
from headrace.plugins.protocols import EngineEnv, EngineSpec

from conftest import running


def test_arrow_vectors_share_the_tensors_memory():
    matrix = torch.randn(5, 8)
    arrow = arrow_vectors(matrix)
    assert arrow.type.list_size == 8 and len(arrow) == 5
    assert arrow.values.buffers()[1].address == matrix.data_ptr()
    matrix[2, 3] = 42.0  # the same memory: a write shows through
    assert arrow[2].values[3].as_py() == 42.0
    view = matrix[1:4]  # a slice of rows, as a batch scheduler hands each request its share
    assert arrow_vectors(view).values.buffers()[1].address == view.data_ptr() == matrix.data_ptr() + 8 * 4


@pytest.mark.parametrize("make", [lambda m: m.to(torch.bfloat16), lambda m: m.t().contiguous().t(),
                                  lambda m: m.double()])
def test_a_tensor_that_cannot_be_wrapped_is_copied_once_and_counted(make):
    stats = HandoffStats()
    src = make(torch.randn(4, 6))
    out = float32_rows(src, stats)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.data_ptr() != src.data_ptr()
    assert stats.received_bytes == stats.copied_bytes == 4 * 6 * 4
    same = float32_rows(out, stats)
    assert same.data_ptr() == out.data_ptr() and stats.copied_bytes == 4 * 6 * 4


def make_env(tmp_path) -> EngineEnv:
    return EngineEnv(data_dir=tmp_path, cache_dir=tmp_path, lookup=lambda name: None)


@pytest.mark.slow
@pytest.mark.anyio
async def test_embedder_output_reaches_the_store_by_reference(tmp_path):
    """Two requests batched into one embed, each handed its rows as a view, ingested and searched
    with no copy: the address the store wraps is the one the embedder produced."""
    # The default config's embedder settings: bf16, padding-free packing.
    spec = EngineSpec(name="emb", plugin="sentence-transformers", options={"dtype": "bfloat16", "pack_tokens": 128})
    embedder = st_embed.factory(spec, make_env(tmp_path))
    store = lancedb_store.factory(EngineSpec(name="vs", plugin="lancedb"), make_env(tmp_path))
    embeds = BatchScheduler("emb", runner_for(embedder), FifoPolicy(), max_batch_size=8, max_wait_ms=200)
    vectors = BatchScheduler("vs", runner_for(store), FifoPolicy(), max_batch_size=8, max_wait_ms=0)
    docs = ("A headrace carries water to the wheel.", "The tailrace carries it away.", "Paris is in France.")
    got: dict[str, torch.Tensor] = {}

    async def embed(key: str, texts: tuple[str, ...]) -> None:
        got[key] = await embeds.submit(EmbedRequest(texts), len(texts))

    async with running(embedder, store):
        async with anyio.create_task_group() as tg:
            await tg.start(embeds.run)
            await tg.start(vectors.run)
            async with anyio.create_task_group() as both:  # queued together: one batch, two views
                both.start_soon(embed, "docs", docs)
                both.start_soon(embed, "question", ("What carries water to the wheel?",))
            doc_vectors, question = got["docs"], got["question"]
            assert not doc_vectors.is_inference() and doc_vectors.dtype == torch.float32
            # One batch: the two results are views of one buffer, in submission order.
            assert doc_vectors.untyped_storage().data_ptr() == question.untyped_storage().data_ptr()

            await vectors.submit(VectorIngest("c", doc_vectors, tuple({"text": d} for d in docs)), len(docs))
            assert store.handoff.last_address == doc_vectors.data_ptr()
            hits = await vectors.submit(VectorSearch("c", question, 2), 1)
            assert store.handoff.last_address == question.data_ptr()
            tg.cancel_scope.cancel()

    assert hits[0][0].payload["text"] == docs[0]
    assert store.handoff.copied_bytes == 0
    assert store.handoff.received_bytes == (len(docs) + 1) * 384 * 4


@pytest.mark.slow
def test_a_rag_run_copies_nothing_between_embedder_and_store(live):
    portal, svc, pool = live
    store = pool.slots["lancedb"].engine
    before = (store.handoff.received_bytes, store.handoff.copied_bytes)
    run = portal.call(svc.run, "naive_rag",
                      {"question": "What does a headrace carry?",
                       "documents": ["A headrace carries water to a mill wheel.", "Paris is in France."]},
                      {"max_tokens": 8})
    assert run.status == "succeeded", run.error
    assert store.handoff.received_bytes > before[0]  # the chunks' vectors and the question's
    assert store.handoff.copied_bytes == before[1]
