"""Semantic-variable sessions without a model: ownership by API key, variables set once, idle expiry.

The calls themselves, on the real LLM, are in test_semantic_calls.py.
"""

from __future__ import annotations

import anyio
import httpx
import pytest

from headrace.daemon.app import create_app
from headrace.daemon.config import ConfigError, load_config

KEY_1, KEY_2 = "key-one", "key-two"
IDLE_SECONDS = 0.5


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def client(tmp_path):
    """The app in-process (no engines: variables need none) with two keys and a short idle time."""
    config = load_config(None, env={"HEADRACE_SERVER_API_KEYS": KEY_2},
                         overrides={"server.api_key": KEY_1, "data.dir": str(tmp_path),
                                    "sessions.idle_seconds": IDLE_SECONDS})
    app = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=bearer(KEY_1)) as c:
            yield c


def error(r: httpx.Response, status: int, param: str | None, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == code, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.anyio
async def test_variables_are_created_set_once_and_read(client):
    r = await client.post("/v1/sessions")
    assert r.status_code == 200, r.text
    session = r.json()
    assert session["object"] == "session" and session["idle_seconds"] == IDLE_SECONDS
    sid = session["id"]
    r = await client.post(f"/v1/sessions/{sid}/variables", json={"name": "topic", "value": "mills"})
    assert r.status_code == 200 and r.json()["state"] == "ready" and r.json()["value"] == "mills"
    r = await client.post(f"/v1/sessions/{sid}/variables", json={"name": "later"})
    assert r.json()["state"] == "pending" and r.json()["value"] is None
    error(await client.post(f"/v1/sessions/{sid}/variables", json={"name": "topic"}), 409, "name", "variable_exists")
    error(await client.post(f"/v1/sessions/{sid}/variables", json={"name": "9lives"}), 400, "name", "invalid_value")
    # A pending variable waits, up to the request's timeout.
    r = await client.get(f"/v1/sessions/{sid}/variables/later", params={"timeout": 0.2})
    error(r, 408, "timeout", "variable_not_ready")
    r = await client.put(f"/v1/sessions/{sid}/variables/later", json={"value": "wheels"})
    assert r.status_code == 200 and r.json()["value"] == "wheels"
    error(await client.put(f"/v1/sessions/{sid}/variables/later", json={"value": "again"}), 409, "variable",
          "variable_already_set")
    error(await client.put(f"/v1/sessions/{sid}/variables/nope", json={"value": "x"}), 404, "variable",
          "variable_not_found")
    error(await client.get(f"/v1/sessions/{sid}/variables/nope"), 404, "variable", "variable_not_found")
    r = await client.get(f"/v1/sessions/{sid}/variables/later", params={"criteria": "latency"})
    assert r.status_code == 200 and r.json()["value"] == "wheels" and r.json()["criteria"] == "latency"
    error(await client.get(f"/v1/sessions/{sid}/variables/later", params={"criteria": "soon"}), 400, "criteria",
          "invalid_value")
    listed = (await client.get(f"/v1/sessions/{sid}")).json()
    assert [v["name"] for v in listed["variables"]] == ["topic", "later"] and listed["calls"] == []


@pytest.mark.anyio
async def test_another_key_cannot_see_a_session_or_its_variables(client):
    sid = (await client.post("/v1/sessions", json={})).json()["id"]
    await client.post(f"/v1/sessions/{sid}/variables", json={"name": "secret", "value": "the mill's password"})
    other = bearer(KEY_2)
    for r in (await client.get(f"/v1/sessions/{sid}", headers=other),
              await client.get(f"/v1/sessions/{sid}/variables/secret", headers=other),
              await client.put(f"/v1/sessions/{sid}/variables/secret", json={"value": "x"}, headers=other),
              await client.post(f"/v1/sessions/{sid}/variables", json={"name": "y"}, headers=other),
              await client.post(f"/v1/sessions/{sid}/calls", json={"template": "{{output:y}}"}, headers=other),
              await client.delete(f"/v1/sessions/{sid}", headers=other)):
        error(r, 404, "session_id", "session_not_found")
        assert "password" not in r.text
    missing = await client.get("/v1/sessions/sess_0000000000000000", headers=other)
    assert missing.json()["error"]["message"].replace("sess_0000000000000000", sid) == \
        (await client.get(f"/v1/sessions/{sid}", headers=other)).json()["error"]["message"]
    r = await client.get(f"/v1/sessions/{sid}/variables/secret")
    assert r.status_code == 200 and r.json()["value"] == "the mill's password"


@pytest.mark.anyio
async def test_an_idle_session_expires_and_a_waiting_one_does_not(client):
    idle = (await client.post("/v1/sessions")).json()["id"]
    waiting = (await client.post("/v1/sessions")).json()["id"]
    await client.post(f"/v1/sessions/{waiting}/variables", json={"name": "x"})
    # A GET blocked on a variable keeps its session alive past the idle time.
    r = await client.get(f"/v1/sessions/{waiting}/variables/x", params={"timeout": 4 * IDLE_SECONDS})
    error(r, 408, "timeout", "variable_not_ready")
    error(await client.get(f"/v1/sessions/{idle}"), 404, "session_id", "session_not_found")
    assert (await client.get(f"/v1/sessions/{waiting}")).status_code == 200
    await anyio.sleep(4 * IDLE_SECONDS)  # no request on it now
    error(await client.get(f"/v1/sessions/{waiting}"), 404, "session_id", "session_not_found")


@pytest.mark.anyio
async def test_delete_closes_the_session_and_wakes_its_waiters(client):
    sid = (await client.post("/v1/sessions")).json()["id"]
    await client.post(f"/v1/sessions/{sid}/variables", json={"name": "x"})
    results = []

    async def wait() -> None:
        results.append(await client.get(f"/v1/sessions/{sid}/variables/x", params={"timeout": 30}))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.2)
        r = await client.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 200 and r.json() == {"id": sid, "object": "session.deleted", "deleted": True}
    error(results[0], 404, "session_id", "session_not_found")
    # Woken from its wait by the delete (a GET sent after it would find no session at all).
    assert "closed while variable 'x' was awaited" in results[0].json()["error"]["message"], results[0].text
    error(await client.get(f"/v1/sessions/{sid}"), 404, "session_id", "session_not_found")


def test_idle_seconds_must_be_positive():
    with pytest.raises(ConfigError):
        load_config(None, env={}, overrides={"sessions.idle_seconds": 0})
