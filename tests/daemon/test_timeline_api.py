"""A run's timeline over HTTP: its primitives, the engines' batches, the Gantt PNG, and isolated runs."""

from __future__ import annotations

import io

import httpx
import pytest

from conftest import API_KEY

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
DOCS = ["A headrace is the channel that carries water to a mill wheel. " * 20,
        "The tailrace carries the water away from the wheel, back to the river. " * 20]
INPUTS = {"question": "What does a headrace carry?", "documents": DOCS}


def run(server, config):
    r = httpx.post(f"{server.base_url}/v1/workflows/advanced_rag/runs", headers=HEADERS, timeout=300,
                   json={"inputs": INPUTS, "config": {"max_tokens": 8, "n_queries": 2, **config}})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    return r.json()


def get(server, path):
    return httpx.get(f"{server.base_url}{path}", headers=HEADERS, timeout=60)


@pytest.fixture(scope="module")
def plain_run(server) -> dict:
    """One advanced_rag run, read by the JSON and the PNG timeline tests."""
    return run(server, {})


def test_timeline_has_nodes_engine_batches_and_pieces(server, plain_run):
    body = plain_run
    tl = get(server, f"/v1/runs/{body['id']}/timeline").json()
    assert tl["run"] == body["id"] and tl["status"] == "succeeded" and tl["seconds"] > 0
    # The expansion's decode, the search and the rerank (split into stages of the reranker's efficient batch).
    engine_of = {n["node"]: n["engine"] for n in tl["nodes"]}
    assert (engine_of.get("expand"), engine_of.get("search")) == ("smollm2", "lancedb"), engine_of
    assert {engine_of[n] for n in engine_of if n.startswith("rerank#")} == {"smollm2-rerank"}, engine_of
    engines = {b["engine"] for b in tl["engines"]}
    assert {"smollm2", "all-minilm-l6-v2"} <= engines
    for b in tl["engines"]:
        assert b["end"] >= b["start"] and b["size"] >= 1
    # The streamed expansion records when it parsed each query, inside its own span.
    streamed = [n for n in tl["nodes"] if n["op"] == "partial_decode"]
    assert streamed and streamed[0]["pieces"]
    assert all(streamed[0]["start"] <= t <= streamed[0]["op_end"] <= streamed[0]["end"] for t in streamed[0]["pieces"])


def test_timeline_png_is_a_gantt_image(server, plain_run):
    body = plain_run
    r = get(server, f"/v1/runs/{body['id']}/timeline.png")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content[:8] == b"\x89PNG\r\n\x1a\n" and len(r.content) > 5000
    assert get(server, "/v1/runs/nope/timeline.png").status_code == 404


def test_isolated_run_computes_one_engine_at_a_time(server):
    body = run(server, {"isolate": True})
    tl = get(server, f"/v1/runs/{body['id']}/timeline").json()
    # A region's source ends with its own primitive (op_end); its record waits for the region too.
    spans = sorted((n["start"], n["op_end"] or n["end"], n["engine"]) for n in tl["nodes"]
                   if n["engine"] and n["start"] is not None)
    assert len({e for _, _, e in spans}) >= 3
    # Node spans on different engines never overlap (those on one engine may: they batch together).
    for i, (s1, e1, g1) in enumerate(spans):
        for s2, e2, g2 in spans[i + 1:]:
            if g1 != g2:
                assert s2 >= e1 - 1e-3 or e2 <= s1 + 1e-3, (g1, s1, e1, g2, s2, e2)
    r = httpx.post(f"{server.base_url}/v1/workflows/naive_rag/runs", headers=HEADERS, timeout=60,
                   json={"inputs": INPUTS, "config": {"isolate": "yes"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "config.isolate"
