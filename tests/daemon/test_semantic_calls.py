"""Semantic calls on the real SmolLM2 behind a real server, with a plain httpx client: chains, a
map-reduce, multi-output calls, bad references, failures that propagate, and delete cancelling work."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import API_KEY, metric_value

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WAIT = 600  # hang guards, not speed targets: a loaded 2-core CPU makes each call take a while
SHORT = {"max_tokens": 12}
DOCS = ["A headrace is the channel that carries water from the river to the mill wheel.",
        "The tailrace carries the spent water away from the wheel, back to the river.",
        "A millpond stores water upstream so that the wheel can turn through a dry spell."]


class Client:
    def __init__(self, server) -> None:
        self.http = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=WAIT + 30)

    def session(self) -> str:
        r = self.http.post("/v1/sessions")
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def var(self, sid: str, name: str, value: str | None = None) -> dict:
        r = self.http.post(f"/v1/sessions/{sid}/variables", json={"name": name, "value": value})
        assert r.status_code == 200, r.text
        return r.json()

    def call(self, sid: str, template: str, **outputs: dict) -> dict:
        r = self.http.post(f"/v1/sessions/{sid}/calls", json={"template": template, "outputs": outputs})
        assert r.status_code == 200, r.text
        return r.json()

    def get(self, sid: str, name: str, **params) -> httpx.Response:
        return self.http.get(f"/v1/sessions/{sid}/variables/{name}", params={"timeout": WAIT, **params})

    def calls(self, sid: str) -> dict[str, dict]:
        return {c["id"]: c for c in self.http.get(f"/v1/sessions/{sid}").json()["calls"]}


@pytest.fixture
def client(server):
    c = Client(server)
    yield c
    c.http.close()


def error(r: httpx.Response, status: int, param: str | None, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["param"], body["code"]) == (param, code), body
    return body["message"]


def test_a_chain_of_three_calls_runs_server_side(client):
    sid = client.session()
    client.var(sid, "doc", DOCS[0])
    first = client.call(sid, "Summarize in a few words: {{input:doc}}\nSummary: {{output:summary}}", summary=SHORT)
    second = client.call(sid, "Give a title for this summary: {{input:summary}}\nTitle: {{output:title}}",
                         title=SHORT)
    third = client.call(sid, "Write one question about \"{{input:title}}\".\nQuestion: {{output:question}}",
                        question=SHORT)
    assert first["inputs"] == ["doc"] and third["outputs"] == ["question"]
    # Nothing was fetched in between: the server chained the calls itself.
    r = client.get(sid, "question", criteria="latency")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "ready" and r.json()["value"].strip() and r.json()["producer"] == third["id"]
    for name in ("summary", "title"):
        assert client.get(sid, name).json()["value"].strip()
    calls = client.calls(sid)
    assert [calls[c["id"]]["status"] for c in (first, second, third)] == ["succeeded"] * 3
    # Fetched for latency: its producer and the call right before it are latency-critical (Parrot §5.2).
    assert [calls[c["id"]]["objective"] for c in (first, second, third)] == ["throughput", "latency", "latency"]


def test_a_map_reduce_feeds_several_calls_into_one(client):
    sid = client.session()
    maps = []
    for i, doc in enumerate(DOCS):
        client.var(sid, f"doc{i}", doc)
        # One template for the maps: they differ only in their input (a task group, a shared prefix).
        maps.append(client.call(sid, f"Summarize in one sentence: {{{{input:doc{i}}}}}\n{{{{output:part{i}}}}}",
                                **{f"part{i}": SHORT}))
    reduce = client.call(sid, "Combine these notes into one sentence:\n- {{input:part0}}\n- {{input:part1}}\n"
                              "- {{input:part2}}\nCombined: {{output:combined}}", combined={"max_tokens": 16})
    r = client.get(sid, "combined", criteria="latency")
    assert r.status_code == 200 and r.json()["value"].strip(), r.text
    calls = client.calls(sid)
    assert {calls[c["id"]]["status"] for c in (*maps, reduce)} == {"succeeded"}
    assert all(calls[c["id"]]["objective"] == "latency" for c in (*maps, reduce))  # the stage right before it
    for i in range(3):
        assert client.get(sid, f"part{i}").json()["value"].strip()


def test_a_call_with_several_outputs_continues_the_prompt(client):
    sid = client.session()
    client.var(sid, "river", "the Thames")
    call = client.call(sid, "Name a town on {{input:river}}: {{output:town}}\nNow name a bridge in that town: "
                            "{{output:bridge}}", town={"max_tokens": 6, "stop": ["\n"]}, bridge={"max_tokens": 8})
    assert call["outputs"] == ["town", "bridge"]
    town, bridge = client.get(sid, "town"), client.get(sid, "bridge")
    assert town.status_code == bridge.status_code == 200, (town.text, bridge.text)
    assert town.json()["value"].strip() and bridge.json()["value"].strip()
    assert town.json()["producer"] == bridge.json()["producer"] == call["id"]
    assert "\n" not in town.json()["value"]  # its own stop string
    assert client.calls(sid)[call["id"]]["status"] == "succeeded"
    # The bridge's prompt is the text before it with the town filled in: it continues the town's prompt.
    again = client.session()
    client.var(again, "river", "the Thames")
    client.var(again, "town", town.json()["value"])
    client.call(again, "Name a town on {{input:river}}: {{input:town}}\nNow name a bridge in that town: "
                       "{{output:bridge}}", bridge={"max_tokens": 8})
    assert client.get(again, "bridge").json()["value"] == bridge.json()["value"]


def test_bad_references_are_4xx_naming_the_field(client):
    sid = client.session()
    client.var(sid, "a", "water")
    client.var(sid, "later")
    post = lambda body: client.http.post(f"/v1/sessions/{sid}/calls", json=body)  # noqa: E731
    error(post({"template": "{{input:nope}} {{output:x}}"}), 400, "template", "variable_not_found")
    error(post({"template": "no placeholders"}), 400, "template", "invalid_value")
    error(post({"template": "{{output:x}} and more"}), 400, "template", "invalid_value")
    error(post({"template": "{{output:x}} {{output:x}}"}), 400, "template", "output_bound_twice")
    error(post({"template": "{{input:a}} {{output:x}}", "outputs": {"y": SHORT}}), 400, "outputs.y", "invalid_value")
    error(post({"template": "{{output:a}}"}), 409, "template", "variable_already_set")
    error(post({"template": "{{input:a}} {{output:a}}"}), 400, "template", "cycle")
    error(post({"template": "{{output:x}}", "outputs": {"x": {"max_tokens": 0}}}), 400, "outputs.x.max_tokens",
          "invalid_value")
    error(post({"template": "{{output:x}}", "model": "all-minilm-l6-v2"}), 400, "model", "model_not_supported")
    error(post({"template": "{{output:x}}", "model": "nope"}), 404, "model", "model_not_found")
    # x <- later, then later <- x: a cycle, refused before it can deadlock.
    first = client.call(sid, "{{input:later}} {{output:x}}", x=SHORT)
    message = error(post({"template": "{{input:x}} {{output:later}}"}), 400, "template", "cycle")
    assert "cycle" in message
    error(post({"template": "{{input:a}} {{output:x}}"}), 409, "template", "output_bound_twice")
    error(client.http.put(f"/v1/sessions/{sid}/variables/x", json={"value": "v"}), 409, "variable",
          "variable_is_output")
    # The refused calls left nothing behind: setting the input runs the one accepted call.
    assert list(client.calls(sid)) == [first["id"]]
    client.http.put(f"/v1/sessions/{sid}/variables/later", json={"value": "Say hello."})
    assert client.get(sid, "x").status_code == 200


def test_a_failed_call_fails_its_outputs_and_the_calls_that_read_them(client):
    sid = client.session()
    client.var(sid, "huge", "water " * 4000)  # past the model's 2048-token context
    failing = client.call(sid, "Summarize: {{input:huge}} {{output:short}}", short=SHORT)
    reader = client.call(sid, "Title for: {{input:short}} {{output:title}}", title=SHORT)
    message = error(client.get(sid, "title"), 424, "variable", "variable_failed")
    assert "short" in message
    error(client.get(sid, "short"), 424, "variable", "variable_failed")
    calls = client.calls(sid)
    assert calls[failing["id"]]["status"] == calls[reader["id"]]["status"] == "failed"
    # The session goes on: a new call runs.
    client.var(sid, "small", "water")
    client.call(sid, "Say {{input:small}}: {{output:said}}", said={"max_tokens": 4})
    assert client.get(sid, "said").status_code == 200


def test_delete_cancels_the_sessions_work(client, server):
    sid = client.session()
    client.var(sid, "topic", "mill wheels")
    call = client.call(sid, "Write a very long essay about {{input:topic}}: {{output:essay}}",
                       essay={"max_tokens": 1500, "temperature": 1.0, "seed": 1})
    deadline = time.monotonic() + WAIT
    while metric_value(server.metrics(), "headrace_llm_contexts", model="smollm2") == 0:
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.05)
    assert client.calls(sid)[call["id"]]["status"] == "running"  # its decode is under way
    r = client.http.delete(f"/v1/sessions/{sid}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    deadline = time.monotonic() + 60
    while metric_value(server.metrics(), "headrace_llm_contexts", model="smollm2") != 0:
        assert time.monotonic() < deadline, "the session's LLM contexts were not freed"
        time.sleep(0.1)
    error(client.http.get(f"/v1/sessions/{sid}"), 404, "session_id", "session_not_found")
