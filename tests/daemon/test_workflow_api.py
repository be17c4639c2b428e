"""The workflow REST API against a real server: runs, SSE events, cancel, graph, disconnect."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from conftest import API_KEY, OTHER_API_KEY, metric_value

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
DOCS = ["A headrace is the channel that carries water to a mill wheel.",
        "The tailrace carries the water away from the wheel, back to the river."]
INPUTS = {"question": "What does a headrace carry?", "documents": DOCS}


def post(server, path, body, **kw):
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=120, **kw)


def get(server, path):
    return httpx.get(f"{server.base_url}{path}", headers=HEADERS, timeout=30)


def test_lists_workflows_with_schemas(server):
    data = get(server, "/v1/workflows").json()["data"]
    names = {w["name"] for w in data}
    assert {"naive_rag", "advanced_rag", "search_gen", "contextual_retrieval", "map_reduce_summary",
            "chain_summary", "fact_verify"} <= names
    naive = next(w for w in data if w["name"] == "naive_rag")
    assert naive["inputs"]["required"] == ["question"]  # and one of documents / collection
    assert naive["config"]["properties"]["top_k"]["default"] == 3


def test_bad_input_is_400_naming_the_field(server):
    r = post(server, "/v1/workflows/naive_rag/runs", {"inputs": {"question": "q"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs.documents"
    r = post(server, "/v1/workflows/naive_rag/runs", {"inputs": INPUTS, "config": {"top_k": "three"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "config.top_k"
    r = post(server, "/v1/workflows/nope/runs", {"inputs": {}})
    assert r.status_code == 404 and r.json()["error"]["code"] == "workflow_not_found"
    r = post(server, "/v1/workflows/naive_rag/runs", {"inputs": INPUTS, "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


def test_run_then_inspect_and_graph(server):
    r = post(server, "/v1/workflows/naive_rag/runs", {"inputs": INPUTS, "config": {"max_tokens": 16}})
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["status"] == "succeeded" and run["result"]["answer"].strip()
    again = get(server, f"/v1/runs/{run['id']}").json()
    assert again["status"] == "succeeded" and again["nodes"]
    node = again["nodes"][0]
    assert {"node", "op", "engine", "start", "end", "state"} <= set(node)
    graph = get(server, f"/v1/runs/{run['id']}/graph").json()
    assert any(n["op"] == "partial_prefill" for n in graph["graph"]["nodes"])
    assert graph["dot"].startswith("digraph")
    dot = httpx.get(f"{server.base_url}/v1/runs/{run['id']}/graph?format=dot", headers=HEADERS)
    assert dot.headers["content-type"].startswith("text/vnd.graphviz")
    assert get(server, "/v1/runs/unknown").status_code == 404


def read_events(response, ids=None):
    """(event, data) pairs of an SSE response; each event's id, when it has one, is appended to ``ids``."""
    event = None
    for line in response.iter_lines():
        if line.startswith("id: ") and ids is not None:
            ids.append(int(line[4:]))
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])


def test_stream_sends_run_and_node_events(server):
    body = {"inputs": INPUTS, "config": {"max_tokens": 16, "n_queries": 2}, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/workflows/advanced_rag/runs", json=body, headers=HEADERS,
                      timeout=120) as r:
        events = list(read_events(r))
    kinds = [e for e, _ in events]
    assert kinds[0] == "run.started" and kinds[-1] == "run.finished"
    assert {"node.started", "node.finished"} <= set(kinds)
    assert any(e == "node.partial" and d["node"] == "expand" for e, d in events)
    assert events[-1][1]["result"]["answer"].strip()


def test_naive_rag_streams_the_answer_tokens(server):
    body = {"inputs": INPUTS, "config": {"max_tokens": 16, "synthesis": "one_shot"}, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/workflows/naive_rag/runs", json=body, headers=HEADERS,
                      timeout=120) as r:
        events = list(read_events(r))
    deltas = [d for e, d in events if e == "node.partial" and "delta" in d]
    assert len(deltas) >= 2, "the answer came in one piece, not token by token"
    graph = get(server, f"/v1/runs/{deltas[0]['run']}/graph").json()["graph"]
    answer_decodes = {n["id"] for n in graph["nodes"] if n["op"] == "decode" and "answer" in n["outputs"]}
    assert len(answer_decodes) == 1 and {d["node"] for d in deltas} == answer_decodes  # the answer's tokens only
    assert all(d["key"] == [] for d in deltas)
    # Every token arrives before the run ends, and together they are the answer.
    assert [e for e, _ in events].index("run.finished") > max(i for i, (e, d) in enumerate(events) if "delta" in d)
    assert "".join(d["delta"] for d in deltas).strip() == events[-1][1]["result"]["answer"]


def test_background_run_and_cancel(server):
    # A question of its own: the same inputs as the other tests would find every prompt and answer cached, and
    # the run could end before the cancel (it did on the Xeon, within the second this test used to sleep).
    inputs = {**INPUTS, "question": f"What does headrace {uuid.uuid4().hex[:8]} carry?"}
    body = {"inputs": inputs, "config": {"max_tokens": 300}, "background": True}
    r = post(server, "/v1/workflows/advanced_rag/runs", body)
    assert r.status_code == 202 and r.json()["status"] in ("queued", "running")
    run_id = r.json()["id"]
    assert r.headers["Location"] == f"/v1/runs/{run_id}"
    assert get(server, r.headers["Location"]).json()["id"] == run_id
    deadline = time.monotonic() + 30
    while get(server, f"/v1/runs/{run_id}").json()["status"] == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)  # cancelled as soon as it runs
    r = httpx.delete(f"{server.base_url}/v1/runs/{run_id}", headers=HEADERS, timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    wait_for_no_contexts(server)


def wait_for_no_contexts(server):
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if metric_value(server.metrics(), "headrace_llm_contexts", model="smollm2") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("LLM contexts were not freed")


def test_disconnect_cancels_a_streaming_run(server):
    body = {"inputs": INPUTS, "config": {"max_tokens": 300}, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/workflows/advanced_rag/runs", json=body, headers=HEADERS,
                      timeout=60) as r:
        events = read_events(r)
        _, first = next(events)
        run_id = first["run"]
    deadline = time.monotonic() + 15
    while get(server, f"/v1/runs/{run_id}").json()["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert get(server, f"/v1/runs/{run_id}").json()["status"] == "cancelled"
    wait_for_no_contexts(server)


def test_a_follower_resumes_after_last_event_id_and_its_leaving_does_not_cancel_the_run(server):
    body = {"inputs": INPUTS, "config": {"max_tokens": 48, "synthesis": "one_shot"}, "background": True}
    run_id = post(server, "/v1/workflows/naive_rag/runs", body).json()["id"]
    first_ids: list[int] = []
    with httpx.stream("GET", f"{server.base_url}/v1/runs/{run_id}/events", headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = read_events(r, first_ids)
        first = [next(events) for _ in range(3)]
    assert first[0][0] == "run.started" and first_ids == [0, 1, 2]
    # The follower left mid-run; the run goes on, and a reconnect resumes right behind the last id it read.
    assert get(server, f"/v1/runs/{run_id}").json()["status"] in ("queued", "running")
    rest_ids: list[int] = []
    with httpx.stream("GET", f"{server.base_url}/v1/runs/{run_id}/events",
                      headers={**HEADERS, "Last-Event-ID": "2"}, timeout=120) as r:
        rest = list(read_events(r, rest_ids))
    assert rest_ids == list(range(3, 3 + len(rest_ids))) and rest[-1][0] == "run.finished"
    assert get(server, f"/v1/runs/{run_id}").json()["status"] == "succeeded"
    # Once it has ended and nobody reads, the run holds only its last event; ?after= says what is gone.
    with httpx.stream("GET", f"{server.base_url}/v1/runs/{run_id}/events?after=-1", headers=HEADERS,
                      timeout=30) as r:
        late = list(read_events(r))
    assert [e for e, _ in late] == ["events.dropped", "run.finished"] and late[0][1]["missed"] == rest_ids[-1]


def test_run_events_refuse_a_bad_resume_point_and_another_keys_run(server):
    body = {"inputs": INPUTS, "config": {"max_tokens": 4, "synthesis": "one_shot"}, "background": True}
    run_id = post(server, "/v1/workflows/naive_rag/runs", body).json()["id"]
    r = httpx.get(f"{server.base_url}/v1/runs/{run_id}/events", headers={**HEADERS, "Last-Event-ID": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
    r = httpx.get(f"{server.base_url}/v1/runs/{run_id}/events?after=-5", headers=HEADERS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    other = {"Authorization": f"Bearer {OTHER_API_KEY}"}
    assert httpx.get(f"{server.base_url}/v1/runs/{run_id}/events", headers=other).status_code == 404


def test_graph_metrics(server):
    m = server.metrics()
    assert metric_value(m, "headrace_egraph_cache_misses_total") >= 1
    assert "headrace_graph_build_seconds_total" in m


def test_runs_lists_the_keys_own_runs_a_page_at_a_time(server):
    from conftest import OTHER_API_KEY

    body = {"inputs": INPUTS, "config": {"max_tokens": 2, "synthesis": "one_shot"}, "background": True}
    mine = [post(server, "/v1/workflows/naive_rag/runs", body).json()["id"] for _ in range(3)]
    other = httpx.post(f"{server.base_url}/v1/workflows/naive_rag/runs", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {OTHER_API_KEY}"}).json()["id"]

    first = get(server, "/v1/runs?limit=2").json()
    assert first["object"] == "list" and [r["id"] for r in first["data"]] == mine[::-1][:2]  # newest first
    assert first["first_id"] == mine[2] and first["last_id"] == mine[1] and first["has_more"] is True
    assert all(r["object"] == "workflow.run" for r in first["data"])
    rest = get(server, f"/v1/runs?limit=2&after={first['last_id']}").json()
    assert rest["data"][0]["id"] == mine[0]
    listed = [r["id"] for r in get(server, "/v1/runs?limit=100").json()["data"]]
    assert set(mine) <= set(listed) and other not in listed  # another key's runs stay hidden
    oldest = get(server, "/v1/runs?order=asc&limit=100").json()
    assert [r["id"] for r in oldest["data"]] == listed[::-1] and oldest["has_more"] is False

    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("bogus=1", "bogus")):
        r = get(server, f"/v1/runs?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
    r = get(server, f"/v1/runs?after={other}")  # a cursor from another key is as unknown as a missing one
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"
