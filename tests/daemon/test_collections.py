"""Persistent collections on the real engines: the /v1/collections routes, RAG runs on a collection,
the ANN index, a restart over the same data dir, and `headrace ingest` against a real server.

One daemon serves the module: the app from ``create_app`` behind uvicorn on 127.0.0.1, on an
event loop the tests can also call into (to run a workflow and keep its retrieved context).
Before it starts, a first app over the same data dir (embedder and store only) creates a
collection: the module's daemon finding it is the restart test.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import lancedb
import pytest
import uvicorn
from anyio.from_thread import start_blocking_portal
from starlette.testclient import TestClient

from conftest import ROOT, free_port, in_process, metric_value
from headrace.daemon.app import create_app, principal
from headrace.daemon.collection_registry import Collection, CollectionRegistry
from headrace.daemon.config import ConfigError, load_config

pytestmark = pytest.mark.slow

KEY = "collections-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ANN_ROWS = 12  # the module's collections.ann_index_rows: small, so one test crosses it
HEADRACE = "A headrace is the channel that carries water from the river to the mill wheel."
TAILRACE = "Downstream of the wheel, spent water returns to the river."
BASALT = "Basalt columns form when thick lava flows cool slowly and crack into hexagons."
QUESTION = "What does a headrace carry?"
INDEXING_OPS = {"chunk", "ingest"}
INDEXING_NODES = {"chunk", "embed_chunks", "ingest", "embed_passages"}


def config_for(data: Path, **overrides):
    return load_config(ROOT / "configs" / "default.toml", env={},
                       overrides={"data.dir": str(data), "server.api_key": KEY, **overrides})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A data dir where an earlier daemon (embedder and store only) left a collection, then stopped."""
    data = tmp_path_factory.mktemp("collections")
    config = config_for(data)
    config = dataclasses.replace(config, engines=[e for e in config.engines
                                                  if e.plugin in ("sentence-transformers", "lancedb")])
    with TestClient(create_app(config)) as client:
        wait_ready(lambda: client.get("/ready").status_code == 200)
        r = client.post("/v1/collections", headers=HEADERS, json={"name": "persist", "chunk_size": 32,
                                                                    "chunk_overlap": 0})
        assert r.status_code == 200, r.text
        r = client.post("/v1/collections/persist/documents", headers=HEADERS,
                        json={"documents": [{"id": "headrace", "text": HEADRACE}, {"id": "basalt", "text": BASALT}]})
        assert r.status_code == 200 and r.json()["chunks"] == 2, r.text
        held = metric_value(client.get("/metrics").text, "headrace_vector_store_cache_bytes", engine="lancedb")
        assert 0 < held < (256 + 64) * 2**20  # the store's session caches, within their default bounds
        # From SIGTERM on, collection changes are refused like any new request (the drain waits for
        # the ones in flight).
        client.portal.call(client.app.state.services.lifecycle.request_drain)
        r = client.post("/v1/collections", headers=HEADERS, json={"name": "late"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    return data


def wait_ready(ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "the daemon did not get ready"
        time.sleep(0.1)


class Daemon:
    """The app behind uvicorn on 127.0.0.1, its event loop reachable through ``portal``."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.app = create_app(config_for(data, **{"collections.ann_index_rows": ANN_ROWS}))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.base_url + path, headers=HEADERS, timeout=60, **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        return httpx.post(self.base_url + path, json=body, headers=HEADERS, timeout=300, **kw)

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(self.base_url + path, headers=HEADERS, timeout=60)

    def run_keeping(self, workflow: str, inputs: dict, config: dict, keep: tuple[str, ...]):
        """A run through the daemon's own workflow service that also returns variables ``keep``
        (the retrieved context), which a run's record over HTTP does not carry. It runs as KEY's, as a
        request with HEADERS would: the collections are KEY's."""
        svc = self.app.state.services.daemon.workflows

        async def go():
            run = await svc.prepare_off_loop(workflow, inputs, config, principal(KEY))
            run.outputs = (*run.outputs, *keep)
            await svc.execute(run)
            return run

        return self.portal.call(go)

    def table(self, name: str):
        return lancedb.connect(str(self.data / "lancedb")).open_table(name)

    def tables(self) -> list[str]:
        return list(lancedb.connect(str(self.data / "lancedb")).list_tables().tables)


@pytest.fixture(scope="module")
def daemon(data_dir):
    d = Daemon(data_dir)
    with start_blocking_portal() as portal:
        d.portal = portal
        serving = portal.start_task_soon(d.server.serve)
        try:
            wait_ready(lambda: d.server.started and httpx.get(f"{d.base_url}/ready", timeout=5).status_code == 200)
            yield d
        finally:
            d.server.should_exit = True
            serving.result(timeout=60)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def ops(run_graph: dict) -> tuple[set[str], set[str]]:
    nodes = run_graph["graph"]["nodes"]
    return {n["op"] for n in nodes}, {n["id"] for n in nodes}


# ----- the routes ------------------------------------------------------------------------


def test_routes_need_the_api_key(daemon):
    r = httpx.get(f"{daemon.base_url}/v1/collections", timeout=30)
    assert error(r, 401)["code"] == "invalid_api_key"


def test_create_list_get_add_replace_delete(daemon):
    r = daemon.post("/v1/collections", {"name": "crud", "chunk_size": 16, "chunk_overlap": 0})
    card = r.json()
    assert r.status_code == 200 and card["id"] == "crud" and card["object"] == "collection", r.text
    assert card["embedding_model"] == "all-minilm-l6-v2" and card["vector_store"] == "lancedb"
    assert (card["documents"], card["chunks"], card["ann_index"]) == (0, 0, False)
    assert error(daemon.post("/v1/collections", {"name": "crud"}), 409)["code"] == "collection_exists"

    long_text = " ".join(f"word{i}" for i in range(40))  # 40 words: 3 chunks of 16
    r = daemon.post("/v1/collections/crud/documents",
                    {"documents": [{"id": "a/long.md", "text": long_text, "metadata": {"lang": "en"}},
                                   {"id": "short", "text": HEADRACE}, {"text": BASALT}]})
    added = r.json()
    assert r.status_code == 200 and added["ids"][:2] == ["a/long.md", "short"] and added["chunks"] == 5, r.text
    listed = {c["id"]: c for c in daemon.get("/v1/collections").json()["data"]}
    assert (listed["crud"]["documents"], listed["crud"]["chunks"]) == (3, 5)
    rows = daemon.table("collection_crud").to_arrow().to_pylist()
    assert sorted(row["id"] for row in rows) == sorted(["a/long.md:0", "a/long.md:1", "a/long.md:2", "short:0",
                                                        f"{added['ids'][2]}:0"])

    # Re-posting an id replaces its chunks: the count of documents stays, the old chunks are gone.
    r = daemon.post("/v1/collections/crud/documents", {"documents": [{"id": "a/long.md", "text": TAILRACE}]})
    assert r.status_code == 200 and r.json()["chunks"] == 1, r.text
    card = daemon.get("/v1/collections/crud").json()
    assert (card["documents"], card["chunks"]) == (3, 3)
    texts = {row["id"]: row["text"] for row in daemon.table("collection_crud").to_arrow().to_pylist()}
    assert texts["a/long.md:0"] == TAILRACE and "a/long.md:1" not in texts and "word5" not in " ".join(texts.values())

    # A document id with '/' is addressed in the path as it is.
    r = daemon.delete("/v1/collections/crud/documents/a/long.md")
    assert r.status_code == 200 and r.json() == {"id": "a/long.md", "object": "collection.document.deleted",
                                                 "deleted": True}, r.text
    card = daemon.get("/v1/collections/crud").json()
    assert (card["documents"], card["chunks"]) == (2, 2)
    assert not [row for row in daemon.table("collection_crud").to_arrow().to_pylist()
                if row["id"].startswith("a/long.md:")]
    assert error(daemon.delete("/v1/collections/crud/documents/a/long.md"), 404)["code"] == "document_not_found"

    # Ids are data, never SQL: quotes and backslashes in one are replaced and deleted like any other.
    odd = "o'brien \\ \"notes\" 100%"
    for text in (BASALT, TAILRACE):
        assert daemon.post("/v1/collections/crud/documents", {"documents": [{"id": odd, "text": text}]}).status_code == 200
    texts = {row["id"]: row["text"] for row in daemon.table("collection_crud").to_arrow().to_pylist()}
    assert texts[f"{odd}:0"] == TAILRACE and daemon.get("/v1/collections/crud").json()["documents"] == 3
    assert daemon.delete("/v1/collections/crud/documents/" + quote(odd)).status_code == 200
    assert daemon.get("/v1/collections/crud").json()["documents"] == 2

    r = daemon.delete("/v1/collections/crud")
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert error(daemon.get("/v1/collections/crud"), 404)["code"] == "collection_not_found"
    assert "crud" not in {c["id"] for c in daemon.get("/v1/collections").json()["data"]}
    assert "collection_crud" not in daemon.tables()
    # The name is free again, and the new collection starts empty.
    assert daemon.post("/v1/collections", {"name": "crud"}).json()["chunks"] == 0
    assert daemon.delete("/v1/collections/crud").status_code == 200


@pytest.mark.parametrize("path, body, param, code", [
    ("/v1/collections", {"name": "bad name!"}, "name", "invalid_value"),
    ("/v1/collections", {"name": "_hidden"}, "name", "invalid_value"),
    ("/v1/collections", {"name": "x" * 65}, "name", "invalid_value"),
    ("/v1/collections", {}, "name", "missing_required_parameter"),
    ("/v1/collections", {"name": "ok", "chunk_size": 64, "chunk_overlap": 64}, "chunk_overlap", "invalid_value"),
    ("/v1/collections", {"name": "ok", "chunk_size": "64"}, "chunk_size", "invalid_value"),
    ("/v1/collections", {"name": "ok", "shards": 2}, "shards", "unsupported_parameter"),
    ("/v1/collections", {"name": "ok", "embedding_model": "smollm2"}, "embedding_model", "model_not_supported"),
    ("/v1/collections/valid/documents", {"documents": []}, "documents", "invalid_value"),
    ("/v1/collections/valid/documents", {"documents": [{"text": "   "}]}, "documents[0].text", "invalid_value"),
    ("/v1/collections/valid/documents", {"documents": [{"text": 3}]}, "documents[0].text", "invalid_value"),
    ("/v1/collections/valid/documents", {"documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]},
     "documents[1].id", "duplicate_document"),
    ("/v1/collections/valid/documents", {"documents": [{"id": "a\nb", "text": "x"}]}, "documents[0].id",
     "invalid_value"),
])
def test_bad_bodies_are_400_naming_the_field(daemon, path, body, param, code):
    if daemon.get("/v1/collections/valid").status_code == 404:
        assert daemon.post("/v1/collections", {"name": "valid"}).status_code == 200
    e = error(daemon.post(path, body), 400)
    assert (e["param"], e["code"], e["type"]) == (param, code, "invalid_request_error"), e


def test_unknown_collection_or_model_is_404(daemon):
    assert error(daemon.post("/v1/collections/nope/documents", {"documents": [{"text": "x"}]}), 404)["code"] == \
        "collection_not_found"
    assert error(daemon.delete("/v1/collections/nope"), 404)["code"] == "collection_not_found"
    assert error(daemon.delete("/v1/collections/nope/documents/x"), 404)["code"] == "collection_not_found"
    e = error(daemon.post("/v1/collections", {"name": "ok", "embedding_model": "missing"}), 404)
    assert (e["param"], e["code"]) == ("embedding_model", "model_not_found")
    assert daemon.get("/v1/collections/ok").status_code == 404  # nothing was created


# ----- workflows on a collection ----------------------------------------------------------


@pytest.fixture(scope="module")
def mills(daemon):
    r = daemon.post("/v1/collections", {"name": "mills", "chunk_size": 32, "chunk_overlap": 0})
    assert r.status_code == 200, r.text
    docs = [{"id": "headrace", "text": HEADRACE}, {"id": "tailrace", "text": TAILRACE}, {"id": "basalt", "text": BASALT}]
    assert daemon.post("/v1/collections/mills/documents", {"documents": docs}).status_code == 200
    return "mills"


def check_no_indexing(run) -> None:
    nodes = run.graph.nodes.values()
    assert not {n.op.value for n in nodes} & INDEXING_OPS and not {n.id for n in nodes} & INDEXING_NODES


def test_naive_rag_answers_from_the_collection(daemon, mills):
    before = set(daemon.tables())
    run = daemon.run_keeping("naive_rag", {"question": QUESTION, "collection": mills},
                             {"top_k": 1, "max_tokens": 8}, keep=("contexts",))
    assert run.status == "succeeded", run.error
    assert run.result["contexts"] == [HEADRACE] and run.result["answer"].strip()
    check_no_indexing(run)
    # The run made no table of its own, and its end dropped nothing: the collection is intact.
    assert set(daemon.tables()) == before and daemon.table("collection_mills").count_rows() == 3


def test_advanced_rag_answers_from_the_collection(daemon, mills):
    run = daemon.run_keeping("advanced_rag", {"question": QUESTION, "collection": mills},
                             {"n_queries": 1, "k_per_query": 2, "top_n": 1, "max_tokens": 8},
                             keep=("pool", "top"))
    assert run.status == "succeeded", run.error
    assert HEADRACE in run.result["pool"] and len(run.result["top"]) == 1
    check_no_indexing(run)
    assert daemon.table("collection_mills").count_rows() == 3


def test_search_gen_searches_the_collection(daemon, mills):
    run = daemon.run_keeping("search_gen", {"question": QUESTION, "collection": mills},
                             {"search": "always", "k": 1, "max_tokens": 4}, keep=("evidence",))
    assert run.status == "succeeded", run.error
    assert run.result["evidence"] == [HEADRACE]
    check_no_indexing(run)


def test_a_run_checks_its_collection_before_it_starts(daemon, mills):
    runs = len(daemon.app.state.services.daemon.workflows.runs)
    e = error(daemon.post("/v1/workflows/naive_rag/runs", {"inputs": {"question": "q", "collection": "nope"}}), 404)
    assert (e["param"], e["code"]) == ("inputs.collection", "collection_not_found")
    e = error(daemon.post("/v1/workflows/naive_rag/runs", {"inputs": {"question": "q", "collection": "no way"}}), 400)
    assert e["param"] == "inputs.collection"
    e = error(daemon.post("/v1/workflows/advanced_rag/runs",
                          {"inputs": {"question": "q", "collection": mills, "documents": ["x"]}}), 400)
    assert e["param"] == "inputs.collection"
    e = error(daemon.post("/v1/workflows/naive_rag/runs", {"inputs": {"question": "q"}}), 400)
    assert e["param"] == "inputs.documents"
    assert daemon.post("/v1/collections", {"name": "empty"}).status_code == 200
    e = error(daemon.post("/v1/workflows/naive_rag/runs", {"inputs": {"question": "q", "collection": "empty"}}), 400)
    assert e["param"] == "inputs.collection" and "no documents" in e["message"]
    assert len(daemon.app.state.services.daemon.workflows.runs) == runs  # none of them became a run


def test_collections_survive_a_restart(daemon):
    card = daemon.get("/v1/collections/persist").json()
    assert (card["documents"], card["chunks"], card["chunk_size"]) == (2, 2, 32), card
    r = daemon.post("/v1/workflows/naive_rag/runs",
                    {"inputs": {"question": QUESTION, "collection": "persist"}, "config": {"top_k": 1, "max_tokens": 8}})
    run = r.json()
    assert r.status_code == 200 and run["status"] == "succeeded" and run["result"]["answer"].strip(), r.text
    graph_ops, node_ids = ops(daemon.get(f"/v1/runs/{run['id']}/graph").json())
    assert "search" in graph_ops and not graph_ops & INDEXING_OPS and not node_ids & INDEXING_NODES


def test_ann_index_once_the_collection_is_large_enough(daemon):
    assert daemon.post("/v1/collections", {"name": "big", "chunk_size": 16, "chunk_overlap": 0}).status_code == 200
    filler = [{"id": f"f{i}", "text": f"Note {i}: the ledger for year {1900 + i} lists grain, timber and salt."}
              for i in range(ANN_ROWS - 2)]
    r = daemon.post("/v1/collections/big/documents", {"documents": filler})
    assert r.status_code == 200 and not daemon.get("/v1/collections/big").json()["ann_index"]
    assert "vector" not in {c for ix in daemon.table("collection_big").list_indices() for c in ix.columns}
    # This ingest reaches the threshold: the index is built after it.
    r = daemon.post("/v1/collections/big/documents", {"documents": [{"id": "headrace", "text": HEADRACE},
                                                                    {"id": "basalt", "text": BASALT}]})
    assert r.status_code == 200, r.text
    assert daemon.get("/v1/collections/big").json()["ann_index"] is True
    table = daemon.table("collection_big")
    index = next(ix for ix in table.list_indices() if "vector" in ix.columns)
    stats = table.index_stats(index.name)
    assert stats.index_type == "IVF_HNSW_SQ" and stats.distance_type == "cosine"
    assert stats.num_indexed_rows == ANN_ROWS
    # LanceDB plans the search through the index, and it still finds the right chunk.
    vector = next(row["vector"] for row in table.to_arrow().to_pylist() if row["id"] == "headrace:0")
    plan = table.search(vector, vector_column_name="vector").distance_type("cosine").limit(1).explain_plan()
    assert "ANNSubIndex" in plan, plan
    run = daemon.run_keeping("naive_rag", {"question": QUESTION, "collection": "big"},
                             {"top_k": 1, "max_tokens": 4}, keep=("contexts",))
    assert run.status == "succeeded", run.error
    assert run.result["contexts"] == [HEADRACE]
    # Chunks added after the index are searched too (exactly, until LanceDB's optimize folds them in).
    assert daemon.post("/v1/collections/big/documents", {"documents": [{"id": "tail", "text": TAILRACE}]}
                       ).status_code == 200
    run = daemon.run_keeping("naive_rag", {"question": "Where does spent water go downstream of the wheel?",
                                           "collection": "big"}, {"top_k": 1, "max_tokens": 4}, keep=("contexts",))
    assert run.status == "succeeded" and run.result["contexts"] == [TAILRACE], run.error


def test_an_unreadable_registry_stops_the_daemon_with_a_config_error(tmp_path):
    (tmp_path / "collections.json").write_text('{"collections": {"x": {"name": ')
    with pytest.raises(ConfigError) as err:
        CollectionRegistry(tmp_path)
    assert err.value.key == "data.dir" and "collections.json" in str(err.value)


@pytest.mark.anyio
async def test_daemons_sharing_a_data_dir_see_and_keep_each_others_changes(tmp_path):
    import anyio

    a, b = CollectionRegistry(tmp_path), CollectionRegistry(tmp_path)  # two daemons, one data dir
    async with a.lock():
        a.collections["docs"] = Collection("docs", "minilm", "lancedb", chunk_size=64, chunk_overlap=0)
        await a.save()
    held = b.get("docs")
    assert held is not None and held.chunk_size == 64
    async with b.lock():
        b.collections["docs"].documents["d1"] = 3
        await b.save()
    assert a.get("docs").documents == {"d1": 3}
    async with a.lock():  # a's change starts from b's: nothing of b's is lost
        a.collections["docs"].documents["d2"] = 1
        await a.save()
    assert b.get("docs") is held and held.documents == {"d1": 3, "d2": 1}  # the same object, updated
    async with a.lock():  # while a holds the lock, b waits for it
        with anyio.move_on_after(0.3) as waited:
            async with b.lock():
                pass
        assert waited.cancelled_caught
    async with b.lock():
        del b.collections["docs"]
        await b.save()
    assert a.get("docs") is None and a.all() == []


# ----- headrace ingest ----------------------------------------------------------------------


@pytest.fixture
def ingest(monkeypatch):
    """``headrace ingest`` in this process (conftest's ``in_process``): no interpreter or torch import per call."""
    from headrace.daemon.commands import main

    monkeypatch.setenv("HEADRACE_API_KEY", "")
    return lambda *args: in_process(main, "ingest", *args)


def test_headrace_ingest_loads_a_tree_of_files(daemon, tmp_path, ingest):
    tree = tmp_path / "notes"
    (tree / "sub").mkdir(parents=True)
    (tree / ".git").mkdir()
    (tree / "mill.md").write_text(f"# Mills\n\n{HEADRACE}\n")
    (tree / "sub" / "rocks.txt").write_text(BASALT)
    (tree / "sub" / "image.png").write_bytes(b"\x89PNG not text")
    (tree / ".git" / "HEAD.md").write_text("ref: refs/heads/main")
    single = tmp_path / "single.txt"
    single.write_text(TAILRACE)

    out = ingest("notes", str(tree), str(single), "--url", daemon.base_url, "--api-key", KEY, "--chunk-size", "64")
    assert out.returncode == 0, out.stderr
    assert "ingested 3 document(s)" in out.stdout
    assert "ingest notes" in out.stderr and "3/3" in out.stderr  # the progress bar
    card = daemon.get("/v1/collections/notes").json()
    assert (card["documents"], card["chunk_size"]) == (3, 64), card
    ids = {row["id"] for row in daemon.table("collection_notes").to_arrow().to_pylist()}
    assert ids == {"mill.md:0", "sub/rocks.txt:0", "single.txt:0"}

    # Again, after an edit: the same ids, so documents are replaced, not added.
    (tree / "mill.md").write_text(TAILRACE)
    out = ingest("notes", str(tree), "--url", daemon.base_url, "--api-key", KEY, "--no-progress")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert daemon.get("/v1/collections/notes").json()["documents"] == 3
    texts = {row["id"]: row["text"] for row in daemon.table("collection_notes").to_arrow().to_pylist()}
    assert texts["mill.md:0"] == TAILRACE


def test_headrace_ingest_errors(daemon, tmp_path, ingest):
    (tmp_path / "a.txt").write_text(HEADRACE)
    out = ingest("notes2", str(tmp_path / "missing"), "--url", daemon.base_url, "--api-key", KEY)
    assert out.returncode == 2 and "no such file or directory" in out.stderr and "missing" in out.stderr
    out = ingest("notes2", str(tmp_path), "--url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "cannot reach the daemon" in out.stderr, out.stderr
    out = ingest("notes2", str(tmp_path), "--url", daemon.base_url)  # no key
    assert out.returncode == 2 and "API key" in out.stderr, out.stderr
    out = ingest("bad name", str(tmp_path), "--url", daemon.base_url, "--api-key", KEY)
    assert out.returncode == 2 and "'name'" in out.stderr, out.stderr
    # A file that is not UTF-8 is skipped with a message; the others still go in, and the status says so.
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    out = ingest("notes2", str(tmp_path), "--url", daemon.base_url, "--api-key", KEY, "--no-progress")
    assert out.returncode == 1 and "skipped" in out.stderr and "latin1.txt" in out.stderr, out.stderr
    assert "ingested 1 document(s)" in out.stdout and "1 file(s) skipped" in out.stdout, out.stdout
    assert daemon.get("/v1/collections/notes2").json()["documents"] == 1
