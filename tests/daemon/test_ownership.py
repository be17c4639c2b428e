"""What each API key owns (docs/deploy.md#what-each-api-key-owns): runs, sessions, stored responses and
collections belong to the key that created them, and another key finds them absent (404 as for an id that
never existed) on read, continue, list, change and delete; a collection made without a key is public and
read-only. Several keys; one Authorization header per request."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from starlette.testclient import TestClient

from conftest import API_KEY, OTHER_API_KEY, in_process
from headrace.daemon.app import create_app, principal
from headrace.daemon.collection_registry import Collection
from headrace.daemon.commands import main
from headrace.daemon.config import load_config
from headrace.daemon.responses_store import StoredResponse
from headrace.graph.executor import Run
from headrace.graph.graph import Graph

KEY_1, KEY_2 = "key-one", "key-two"
RUN_ROUTES = ["", "/graph", "/timeline", "/timeline.png"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def app_client(tmp_path):
    """The app in-process with two keys and no engines: the auth and run routes need no model."""
    config = load_config(None, env={"HEADRACE_SERVER_API_KEYS": KEY_2},
                         overrides={"server.api_key": KEY_1, "data.dir": str(tmp_path)})
    app = create_app(config)
    with TestClient(app) as client:
        yield app, client


def finished_run(app, client: TestClient, owner: str | None) -> Run:
    """A finished run record owned by ``owner``, made on the app's loop (its events belong to it)."""

    def make() -> Run:
        run = Run(workflow="naive_rag", graph=Graph("naive_rag"), inputs={}, outputs=(), owner=owner)
        run.status, run.finished = "succeeded", run.started
        run.done.set()
        app.state.services.daemon.workflows.runs[run.id] = run
        return run

    return client.portal.call(make)


def test_every_key_is_accepted_and_a_missing_or_wrong_one_is_401(app_client):
    app, client = app_client
    for key in (KEY_1, KEY_2):
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["message"] == "missing API key"
    r = client.get("/v1/models", headers=bearer("key-three"))
    assert r.status_code == 401 and r.json()["error"]["message"] == "incorrect API key"
    assert KEY_1 not in r.text and KEY_2 not in r.text
    assert client.get("/health").status_code == 200  # probes need no key


def test_duplicate_authorization_header_is_400(app_client):
    app, client = app_client
    for pair in ((KEY_1, KEY_1), (KEY_1, KEY_2), (KEY_1, "wrong")):
        headers = [("Authorization", f"Bearer {pair[0]}"), ("Authorization", f"Bearer {pair[1]}")]
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "more than one Authorization header", "type": "invalid_request_error",
                                     "param": "Authorization", "code": "duplicate_authorization"}


def test_another_keys_run_is_404_on_every_run_route(app_client):
    app, client = app_client
    run = finished_run(app, client, principal(KEY_1))
    for suffix in RUN_ROUTES:
        r = client.get(f"/v1/runs/{run.id}{suffix}", headers=bearer(KEY_2))
        assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found", (suffix, r.text)
        missing = client.get(f"/v1/runs/0000000000000000{suffix}", headers=bearer(KEY_2))
        assert missing.json()["error"]["message"].replace("0000000000000000", run.id) == r.json()["error"]["message"]
        assert client.get(f"/v1/runs/{run.id}{suffix}", headers=bearer(KEY_1)).status_code == 200, suffix
    r = client.delete(f"/v1/runs/{run.id}", headers=bearer(KEY_2))
    assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found"
    r = client.delete(f"/v1/runs/{run.id}", headers=bearer(KEY_1))
    assert r.status_code == 200 and r.json()["status"] == "succeeded"


def absent_as_a_missing_id(r: httpx.Response, missing: httpx.Response, thing_id: str, fake_id: str) -> None:
    """``r`` (another key's thing) is the 404 a never-existing id gets, word for word."""
    assert r.status_code == 404 == missing.status_code, r.text
    assert r.json()["error"] == {**missing.json()["error"],
                                 "message": missing.json()["error"]["message"].replace(fake_id, thing_id)}


def test_another_keys_stored_response_is_absent(app_client):
    app, client = app_client
    store = app.state.services.responses
    response = {"id": "resp_a", "object": "response", "output": [], "status": "completed"}
    items = [{"id": "msg_1", "type": "message", "role": "user", "status": "completed",
              "content": [{"type": "input_text", "text": "a secret"}]}]
    client.portal.call(store.put, StoredResponse("resp_a", principal(KEY_1), time.time(), "", response, items, []))
    for suffix in ("", "/input_items"):
        absent_as_a_missing_id(client.get(f"/v1/responses/resp_a{suffix}", headers=bearer(KEY_2)),
                               client.get(f"/v1/responses/resp_zz{suffix}", headers=bearer(KEY_2)), "resp_a", "resp_zz")
    absent_as_a_missing_id(client.delete("/v1/responses/resp_a", headers=bearer(KEY_2)),
                           client.delete("/v1/responses/resp_zz", headers=bearer(KEY_2)), "resp_a", "resp_zz")
    assert client.get("/v1/responses/resp_a", headers=bearer(KEY_1)).json() == response  # the refusals took nothing
    assert client.get("/v1/responses/resp_a/input_items", headers=bearer(KEY_1)).json()["data"] == items
    assert client.delete("/v1/responses/resp_a", headers=bearer(KEY_1)).json()["deleted"] is True
    assert client.get("/v1/responses/resp_a", headers=bearer(KEY_1)).status_code == 404


def put_collection(app, client: TestClient, name: str, owner: str | None) -> None:
    registry = app.state.services.daemon.collections

    async def put() -> None:
        async with registry.lock():
            registry.collections[name] = Collection(name, "minilm", "lancedb", 16, 0, documents={"d": 1}, owner=owner)
            await registry.save()

    client.portal.call(put)


def test_another_keys_collection_is_absent_and_left_out_of_lists_and_runs(app_client):
    app, client = app_client
    put_collection(app, client, "owned", principal(KEY_1))
    other = bearer(KEY_2)
    for method, suffix, body in (("GET", "", None), ("DELETE", "", None), ("POST", "/documents", {"documents": []}),
                                 ("DELETE", "/documents/d", None)):
        absent_as_a_missing_id(client.request(method, f"/v1/collections/owned{suffix}", json=body, headers=other),
                               client.request(method, f"/v1/collections/nope{suffix}", json=body, headers=other),
                               "owned", "nope")
    assert client.get("/v1/collections", headers=other).json()["data"] == []
    run = {"inputs": {"question": "q", "collection": "owned"}}
    r = client.post("/v1/workflows/naive_rag/runs", json=run, headers=other)
    assert r.status_code == 404 and r.json()["error"]["code"] == "collection_not_found", r.text
    # The owner sees it, and its run gets past the collection (to the engines this app has not got).
    assert [c["id"] for c in client.get("/v1/collections", headers=bearer(KEY_1)).json()["data"]] == ["owned"]
    assert client.get("/v1/collections/owned", headers=bearer(KEY_1)).status_code == 200
    r = client.post("/v1/workflows/naive_rag/runs", json=run, headers=bearer(KEY_1))
    assert r.status_code == 400 and "'minilm', which is not configured" in r.json()["error"]["message"], r.text
    assert app.state.services.daemon.collections.get("owned") is not None  # B's delete removed nothing


def test_a_collection_made_without_a_key_is_public_and_read_only_while_keys_are_configured(app_client, tmp_path):
    app, client = app_client
    put_collection(app, client, "shared", None)
    for key in (KEY_1, KEY_2):
        assert client.get("/v1/collections/shared", headers=bearer(key)).status_code == 200
        assert [c["id"] for c in client.get("/v1/collections", headers=bearer(key)).json()["data"]] == ["shared"]
        for method, suffix, body in (("DELETE", "", None), ("POST", "/documents", {"documents": []}),
                                     ("DELETE", "/documents/d", None)):
            r = client.request(method, f"/v1/collections/shared{suffix}", json=body, headers=bearer(key))
            assert r.status_code == 403 and r.json()["error"]["code"] == "collection_read_only", r.text
    # Without keys it is everyone's, as every collection is: it can be deleted.
    with TestClient(create_app(load_config(None, env={}, overrides={"data.dir": str(tmp_path)}))) as keyless:
        assert keyless.delete("/v1/collections/shared").json()["deleted"] is True


def test_another_keys_run_is_left_out_of_the_list(app_client):
    app, client = app_client
    run = finished_run(app, client, principal(KEY_1))
    assert client.get("/v1/runs", headers=bearer(KEY_2)).json()["data"] == []
    r = client.get(f"/v1/runs?after={run.id}", headers=bearer(KEY_2))
    assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found"
    assert [r["id"] for r in client.get("/v1/runs", headers=bearer(KEY_1)).json()["data"]] == [run.id]


def test_principal_is_a_digest_never_the_key():
    assert principal(KEY_1) != principal(KEY_2)
    assert KEY_1 not in principal(KEY_1) and principal(KEY_1) == principal(KEY_1)


def test_without_keys_everyone_is_one_owner(tmp_path):
    app = create_app(load_config(None, env={}, overrides={"data.dir": str(tmp_path)}))
    with TestClient(app) as client:
        run = finished_run(app, client, None)
        assert client.get(f"/v1/runs/{run.id}").status_code == 200
        assert client.get(f"/v1/runs/{run.id}", headers=bearer("anything")).status_code == 200


@pytest.mark.slow
def test_a_run_created_with_one_key_is_hidden_from_another(server):
    """End to end on the real daemon (the session server accepts API_KEY and OTHER_API_KEY)."""
    body = {"inputs": {"question": "What does a headrace carry?",
                       "documents": ["A headrace carries water to a mill wheel."]},
            "config": {"max_tokens": 8}, "background": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        r = client.post("/v1/workflows/naive_rag/runs", json=body, headers=bearer(API_KEY))
        assert r.status_code == 202, r.text
        run_id = r.json()["id"]
        for suffix in RUN_ROUTES:
            r = client.get(f"/v1/runs/{run_id}{suffix}", headers=bearer(OTHER_API_KEY))
            assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found", suffix
        assert client.delete(f"/v1/runs/{run_id}", headers=bearer(OTHER_API_KEY)).status_code == 404
        # The other key's refusal cancelled nothing: the owner sees the run through to its end.
        r = client.get(f"/v1/runs/{run_id}", headers=bearer(API_KEY))
        assert r.status_code == 200 and r.json()["status"] in ("queued", "running", "succeeded")
        for suffix in RUN_ROUTES[1:]:
            assert client.get(f"/v1/runs/{run_id}{suffix}", headers=bearer(API_KEY)).status_code == 200, suffix
        r = client.delete(f"/v1/runs/{run_id}", headers=bearer(API_KEY))
        assert r.status_code == 200 and r.json()["status"] in ("succeeded", "cancelled")
        r = client.get(f"/v1/runs/{run_id}", headers=[("Authorization", f"Bearer {API_KEY}")] * 2)
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_authorization"
        assert client.get(f"/v1/runs/{run_id}").status_code == 401


@pytest.mark.slow
def test_another_key_cannot_read_continue_list_or_delete_what_a_key_made(server, tmp_path):
    """End to end on the real daemon and models: a stored response, a session with a call, a collection with
    a document and a run on it, made with API_KEY; OTHER_API_KEY finds each absent; API_KEY still has each."""
    mine, theirs = bearer(API_KEY), bearer(OTHER_API_KEY)
    name = f"owned-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        def ok(method: str, path: str, body: dict | None = None) -> dict:
            r = client.request(method, path, json=body, headers=mine)
            assert r.status_code == 200, (path, r.text)
            return r.json()

        def absent(method: str, path: str, body: dict | None = None, code: str | None = None) -> None:
            r = client.request(method, path, json=body, headers=theirs)
            assert r.status_code == 404, (method, path, r.text)
            assert code is None or r.json()["error"]["code"] == code, r.text

        response = ok("POST", "/v1/responses", {"model": "smollm2", "input": "My secret is 7.", "max_output_tokens": 2})
        rid = response["id"]
        absent("GET", f"/v1/responses/{rid}", code="response_not_found")
        absent("GET", f"/v1/responses/{rid}/input_items", code="response_not_found")
        absent("POST", "/v1/responses", {"model": "smollm2", "input": "What was my secret?", "max_output_tokens": 2,
                                         "previous_response_id": rid}, code="response_not_found")
        absent("DELETE", f"/v1/responses/{rid}", code="response_not_found")

        session = ok("POST", "/v1/sessions", {})["id"]
        ok("POST", f"/v1/sessions/{session}/calls", {"template": "A word: {{output:w}}", "outputs": {"w": {"max_tokens": 2}}})
        for method, suffix, body in (("GET", "", None), ("GET", "/variables/w", None),
                                     ("POST", "/variables", {"name": "x", "value": "y"}),
                                     ("POST", "/calls", {"template": "{{output:z}}"}), ("DELETE", "", None)):
            absent(method, f"/v1/sessions/{session}{suffix}", body, code="session_not_found")

        ok("POST", "/v1/collections", {"name": name, "chunk_size": 16, "chunk_overlap": 0})
        ok("POST", f"/v1/collections/{name}/documents",
           {"documents": [{"id": "mill", "text": "A headrace carries water to a mill wheel."}]})
        run_body = {"inputs": {"question": "What does a headrace carry?", "collection": name}, "config": {"max_tokens": 4}}
        absent("POST", "/v1/workflows/naive_rag/runs", run_body, code="collection_not_found")
        assert name not in [c["id"] for c in client.get("/v1/collections", headers=theirs).json()["data"]]
        for method, suffix, body in (("GET", "", None), ("POST", "/documents", {"documents": [{"text": "x"}]}),
                                     ("DELETE", "/documents/mill", None), ("DELETE", "", None)):
            absent(method, f"/v1/collections/{name}{suffix}", body, code="collection_not_found")
        # `headrace ingest` with the other key: the name is taken, and it says so rather than "not found".
        (tmp_path / "note.txt").write_text("A tailrace carries water away.")
        out = in_process(main, "ingest", name, str(tmp_path), "--url", server.base_url, "--api-key", OTHER_API_KEY,
                         "--no-progress")
        assert out.returncode == 2 and "taken by another API key's collection" in out.stderr, out.stderr
        run = ok("POST", "/v1/workflows/naive_rag/runs", run_body)
        assert run["status"] == "succeeded", run
        assert run["id"] not in [r["id"] for r in client.get("/v1/runs", headers=theirs).json()["data"]]
        absent("GET", f"/v1/runs/{run['id']}", code="run_not_found")
        absent("DELETE", f"/v1/runs/{run['id']}", code="run_not_found")

        # The owner still has every one of them, whole.
        assert ok("GET", f"/v1/responses/{rid}") == response
        assert ok("GET", f"/v1/responses/{rid}/input_items")["data"][0]["content"][0]["text"] == "My secret is 7."
        ok("POST", "/v1/responses", {"model": "smollm2", "input": "And?", "max_output_tokens": 2,
                                     "previous_response_id": rid})
        assert ok("GET", f"/v1/sessions/{session}")["id"] == session
        assert ok("GET", f"/v1/collections/{name}")["documents"] == 1
        assert run["id"] in [r["id"] for r in ok("GET", "/v1/runs?limit=100&order=desc")["data"]]
        assert ok("DELETE", f"/v1/responses/{rid}")["deleted"] is True
        assert ok("DELETE", f"/v1/sessions/{session}")["deleted"] is True
        assert ok("DELETE", f"/v1/collections/{name}")["deleted"] is True
