"""Runs belong to the API key that created them; several keys; one Authorization header per request."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from conftest import API_KEY, OTHER_API_KEY
from headrace.daemon.app import create_app, principal
from headrace.daemon.config import load_config
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
