"""The LanceDB vector store: collections, cosine search, full-text search, errors."""

from pathlib import Path

import pytest
import torch

from headrace.plugins.engines.retrieval import lancedb_store
from headrace.plugins.engines.retrieval.lancedb_store import CollectionNotFound
from headrace.plugins.protocols import EngineEnv, EngineSpec, VectorStore

from conftest import running

pytestmark = pytest.mark.anyio

DOCS = [
    "LanceDB stores vectors in columnar files",
    "The quick brown fox jumps over the lazy dog",
    "Sourdough bread needs a lively starter",
    "Tidal power turns a headrace into electricity",
]




def make_store(tmp_path: Path, **options) -> lancedb_store.LanceDBStore:
    env = EngineEnv(data_dir=tmp_path, cache_dir=tmp_path, lookup=lambda name: None)
    return lancedb_store.factory(EngineSpec(name="vs", plugin="lancedb", options=options), env)


def unit_rows(n: int, dim: int) -> torch.Tensor:
    """Orthogonal-ish unit vectors, one per row: e_i plus a little of e_{i+1}."""
    vecs = torch.zeros(n, dim)
    for i in range(n):
        vecs[i, i % dim] = 1.0
        vecs[i, (i + 1) % dim] = 0.1
    return torch.nn.functional.normalize(vecs, dim=1)


def test_registers_its_kind():
    found = {}
    lancedb_store.register_engines(register=lambda kind, factory: found.setdefault(kind, factory))
    assert found == {"lancedb": lancedb_store.factory}


async def test_ingest_then_vector_search(tmp_path):
    store = make_store(tmp_path)
    assert isinstance(store, VectorStore)
    vecs = unit_rows(len(DOCS), 8)
    payloads = [{"text": t, "n": i} for i, t in enumerate(DOCS)]
    payloads[0]["id"] = "first"

    async with running(store):
        ids = await store.ingest("docs", vecs, payloads)
        assert ids[0] == "first" and len(set(ids)) == len(DOCS)
        assert (tmp_path / "lancedb" / "docs.lance").is_dir()

        hits = await store.search("docs", vecs[[2, 0]], k=2)
        assert [len(h) for h in hits] == [2, 2]
        assert hits[0][0].id == ids[2] and hits[1][0].id == "first"
        assert hits[0][0].score == pytest.approx(1.0, abs=1e-5)
        assert hits[0][0].score >= hits[0][1].score
        assert hits[0][0].payload == {"text": DOCS[2], "n": 2}
        # A 1-D query vector is one query; k larger than the collection returns everything.
        (everything,) = await store.search("docs", vecs[1], k=10)
        assert len(everything) == len(DOCS)
        expected = (vecs @ vecs[1]).tolist()
        for hit in everything:
            assert hit.score == pytest.approx(expected[hit.payload["n"]], abs=1e-5)


async def test_drop_deletes_a_collection_and_ignores_a_missing_one(tmp_path):
    store = make_store(tmp_path)
    async with running(store):
        await store.ingest("run_abc", unit_rows(2, 4), [{"text": t} for t in DOCS[:2]])
        assert (tmp_path / "lancedb" / "run_abc.lance").is_dir()
        await store.drop("run_abc")
        assert not (tmp_path / "lancedb" / "run_abc.lance").exists()
        with pytest.raises(CollectionNotFound):
            await store.search("run_abc", unit_rows(1, 4), k=1)
        await store.drop("run_abc")  # already gone: no error
        # The name can be used afresh, with another dimension.
        await store.ingest("run_abc", unit_rows(1, 6), [{"text": DOCS[0]}])
        assert len((await store.search("run_abc", unit_rows(1, 6), k=1))[0]) == 1


async def test_full_text_search_and_second_ingest(tmp_path):
    store = make_store(tmp_path, path=str(tmp_path / "elsewhere"), fts_reindex_rows=2)
    vecs = unit_rows(len(DOCS), 8)
    async with running(store):
        ids = await store.ingest("docs", vecs[:2], [{"text": t} for t in DOCS[:2]])
        hits = await store.search_text("docs", "fox", k=5)
        assert [h.id for h in hits] == [ids[1]] and hits[0].score > 0

        # One row: below the reindex threshold, so found by LanceDB's scan of unindexed rows.
        (bread,) = await store.ingest("docs", vecs[2:3], [{"text": DOCS[2], "id": "bread"}])
        assert [h.id for h in await store.search_text("docs", "sourdough", k=5)] == [bread]
        # The next row reaches the threshold, and optimize() folds both into the index.
        await store.ingest("docs", vecs[3:4], [{"text": DOCS[3], "id": "tidal"}])
        assert [h.id for h in await store.search_text("docs", "headrace", k=5)] == ["tidal"]
        assert [h.id for h in await store.search_text("docs", "starter", k=5)] == [bread]
        assert (await store.search("docs", vecs[3:4], k=1))[0][0].id == "tidal"
        # k bounds full-text results too; a blank query finds nothing.
        assert len(await store.search_text("docs", "fox bread headrace", k=2)) == 2
        assert await store.search_text("docs", "   ", k=3) == []
    assert (tmp_path / "elsewhere" / "docs.lance").is_dir()


async def test_rows_persist_across_restarts(tmp_path):
    vecs = unit_rows(2, 4)
    async with running(store := make_store(tmp_path)):
        await store.ingest("docs", vecs, [{"text": "alpha", "id": "a"}, {"text": "beta", "id": "b"}])
    async with running(store := make_store(tmp_path)):
        assert (await store.search("docs", vecs[1:], k=1))[0][0].id == "b"
        assert [h.id for h in await store.search_text("docs", "alpha", k=1)] == ["a"]


async def test_errors(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(RuntimeError, match="not running"):
        await store.search("docs", unit_rows(1, 4), k=1)
    async with running(store):
        with pytest.raises(CollectionNotFound, match="'nope'") as info:
            await store.search("nope", unit_rows(1, 4), k=1)
        assert isinstance(info.value, KeyError)
        with pytest.raises(CollectionNotFound):
            await store.search_text("nope", "anything", k=1)

        await store.ingest("docs", unit_rows(2, 4), [{"text": "a"}, {"text": "b"}])
        with pytest.raises(ValueError, match="4-dimensional"):
            await store.ingest("docs", unit_rows(1, 5), [{"text": "c"}])
        with pytest.raises(ValueError, match="4-dimensional"):
            await store.search("docs", unit_rows(1, 3), k=1)
        with pytest.raises(ValueError, match="2 vectors but 1 payloads"):
            await store.ingest("docs", unit_rows(2, 4), [{"text": "c"}])
        with pytest.raises(ValueError, match="collection name"):
            await store.ingest("../escape", unit_rows(1, 4), [{"text": "c"}])
        with pytest.raises(ValueError, match="k must be"):
            await store.search("docs", unit_rows(1, 4), k=0)
        # Nothing above was written.
        assert len((await store.search("docs", unit_rows(1, 4), k=10))[0]) == 2


@pytest.mark.slow
async def test_with_real_embeddings(tmp_path):
    from headrace.plugins.engines.retrieval import st_embed

    env = EngineEnv(data_dir=tmp_path, cache_dir=tmp_path, lookup=lambda name: None)
    embedder = st_embed.factory(EngineSpec(name="emb", plugin="sentence-transformers"), env)
    store = make_store(tmp_path)
    async with running(embedder, store):
        await store.ingest("docs", await embedder.embed(DOCS), [{"text": t} for t in DOCS])
        (hits,) = await store.search("docs", await embedder.embed(["how do I bake bread?"]), k=2)
        assert hits[0].payload["text"] == DOCS[2]
        assert 0 < hits[1].score < hits[0].score <= 1


async def _replace_and_search(store, cycles: int) -> list[int]:
    """A daemon that keeps ingesting: each cycle replaces a slot's rows (a delete and an add) and searches; the
    session cache's bytes after each cycle."""
    vecs = unit_rows(8, 8)
    await store.ingest("docs", vecs, [{"text": f"{DOCS[i % 4]} {i}", "id": f"base-{i}"} for i in range(8)])
    held = []
    for i in range(cycles):
        ids = [f"slot-{i % 4}-{j}" for j in range(2)]
        await store.delete_rows("docs", ids)
        await store.ingest("docs", vecs[:2], [{"text": DOCS[j], "id": row_id} for j, row_id in enumerate(ids)])
        await store.search("docs", vecs[[i % 8]], k=3)
        held.append(store.stats()["store_cache_bytes"])
    return held


async def test_the_session_cache_stays_within_its_bound_where_lancedbs_default_grows(tmp_path):
    bounded = make_store(tmp_path / "bounded", metadata_cache_mib=1, index_cache_mib=1)
    async with running(bounded):
        held = await _replace_and_search(bounded, 200)
    assert max(held[-40:]) < 1.5 * 2**20, held[-1]  # LanceDB's bound is approximate: a little over, never growing
    default = make_store(tmp_path / "default", metadata_cache_mib=1024, index_cache_mib=6144)  # LanceDB's own
    async with running(default):
        grown = await _replace_and_search(default, 200)
    assert grown[-1] > 2 * 2**20 and grown[-1] > grown[99] > grown[0], grown[::40]  # what the bound stops


@pytest.mark.parametrize("option", ["index_cache_mib", "metadata_cache_mib"])
@pytest.mark.parametrize("value", [0, -1, 2.5, "64", True])
def test_a_bad_cache_bound_names_its_key(tmp_path, option, value):
    with pytest.raises(ValueError, match=rf"engines\.vs\.options\.{option}: must be an integer >= 1"):
        make_store(tmp_path, **{option: value})
