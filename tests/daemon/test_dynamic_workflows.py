"""The built-in traced workflows (debate, agent, router) live over HTTP on the real models.

A real ``headrace serve`` with the default config (SmolLM2-135M on the CPU): tiny token budgets,
two agents, two rounds. What a 135M model writes varies; what the workflows guarantee does not:
constrained choices parse, the graph holds what the run unfolded, the bounds hold.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import API_KEY

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
HEADRACE = "A headrace is the channel that carries water from the river to the mill wheel."
BASALT = "Basalt columns form when thick lava flows cool slowly and crack into hexagons."
COLLECTION = "dynamic_mills"


def post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=300)


def get(server, path):
    return httpx.get(f"{server.base_url}{path}", headers=HEADERS, timeout=30)


def run(server, workflow, inputs, config) -> dict:
    r = post(server, f"/v1/workflows/{workflow}/runs", {"inputs": inputs, "config": config})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "succeeded", body["error"]
    return body


def graph_nodes(server, run_id) -> dict[str, dict]:
    return {n["id"]: n for n in get(server, f"/v1/runs/{run_id}/graph").json()["graph"]["nodes"]}


@pytest.fixture(scope="module")
def collection(server):
    r = post(server, "/v1/collections", {"name": COLLECTION, "chunk_size": 32, "chunk_overlap": 0})
    assert r.status_code == 200, r.text
    docs = [{"id": "headrace", "text": HEADRACE}, {"id": "basalt", "text": BASALT}]
    assert post(server, f"/v1/collections/{COLLECTION}/documents", {"documents": docs}).status_code == 200
    return COLLECTION


def test_the_traced_workflows_are_listed(server):
    data = {w["name"]: w for w in get(server, "/v1/workflows").json()["data"]}
    assert {"debate", "agent", "router"} <= set(data)
    assert data["debate"]["outputs"] == ["answer", "rounds", "agreed", "chosen"]
    assert data["router"]["config"]["properties"]["route"]["enum"] == ["auto", "direct", "search", "compute"]


def test_debate(server):
    body = run(server, "debate", {"question": "Why is the sky blue?"}, {"agents": 2, "rounds": 2, "max_tokens": 6})
    result = body["result"]
    assert isinstance(result["answer"], str) and result["answer"].strip()
    assert result["chosen"] in (1, 2)
    # Agreement after the first round stops early; else the second round is the last.
    assert result["rounds"] == (1 if result["agreed"] else 2)
    nodes = graph_nodes(server, body["id"])
    answers = [n for n, node in nodes.items() if n.startswith("agent.") and node["op"] == "decode"]
    assert len(answers) == 2 * result["rounds"]
    assert "agree.3" in nodes and any(n.startswith("judge.") for n in nodes)
    # The verdict's prompt was issued before the answers it reads were done: its ready prefix
    # (the question) was split off and prefilled early.
    assert nodes["agree.3.prefill.partial"]["op"] == "partial_prefill"


def test_agent_on_a_collection(server, collection):
    body = run(server, "agent", {"question": "What does a headrace carry? Search the documents.",
                                 "collection": collection}, {"max_steps": 2, "k": 1, "max_tokens": 6})
    result = body["result"]
    assert result["answer"].strip() and 1 <= len(result["steps"]) <= 2
    # Asked to search, the greedy 135M model searches first: the branch below is taken.
    assert result["steps"][0]["action"] == "search", result["steps"]
    for step in result["steps"]:
        assert step["action"] in ("search", "calculate", "answer") and step["input"]
        if step["action"] == "search":  # its observation is a chunk of the collection
            assert step["observation"] in (HEADRACE, BASALT)
    nodes = graph_nodes(server, body["id"])
    decisions = [n for n, node in nodes.items() if n.startswith("step.") and node["op"] == "decode"]
    assert len(decisions) == len(result["steps"])  # one constrained decision per step
    searches = [n for n, node in nodes.items() if node["op"] == "search"]
    assert len(searches) == sum(s["action"] == "search" for s in result["steps"])


def test_agent_calculates(server):
    # The calculator forced (the action left free, the greedy 135M model answered directly on the Xeon's AMX
    # kernels and used the calculator on the EPYC's); the expression is still the model's to write.
    body = run(server, "agent", {"question": "Use the calculator: what is 12 * (3 + 4)?"},
               {"max_steps": 1, "max_tokens": 6, "actions": ["calculate"]})
    steps = body["result"]["steps"]
    assert len(steps) == 1 and steps[0]["action"] == "calculate", steps
    assert steps[0]["input"].replace(" ", "") == "12*(3+4)" and steps[0]["observation"] == "84"
    assert any(n.startswith("calculator.") for n in graph_nodes(server, body["id"]))


def test_router_routes(server, collection):
    auto = run(server, "router", {"question": "What is 12 times 7?", "collection": collection}, {"max_tokens": 6})
    assert auto["result"]["route"] in ("direct", "search", "compute") and auto["result"]["answer"].strip()
    assert "route.1" in graph_nodes(server, auto["id"])

    searched = run(server, "router", {"question": "What does a headrace carry?", "collection": collection},
                   {"route": "search", "k": 1, "max_tokens": 6})
    nodes = graph_nodes(server, searched["id"])
    assert searched["result"]["route"] == "search" and {"search.1.embed", "search.1"} <= set(nodes)
    # The answer was issued with the hits unawaited: its prompt's ready part was prefilled during the search.
    assert nodes["answer.2.prefill.partial"]["op"] == "partial_prefill"

    computed = run(server, "router", {"question": "What is 12 times 7?"}, {"route": "compute", "max_tokens": 6})
    nodes = graph_nodes(server, computed["id"])
    assert computed["result"]["route"] == "compute" and {"expression.1", "calculator.2", "answer.3"} <= set(nodes)


def test_bad_inputs_are_400_naming_the_field(server):
    r = post(server, "/v1/workflows/router/runs", {"inputs": {"question": "q"}, "config": {"route": "search"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "config.route"
    r = post(server, "/v1/workflows/agent/runs", {"inputs": {"question": "q", "collection": "missing"}})
    assert r.status_code == 404 and r.json()["error"]["param"] == "inputs.collection"
    r = post(server, "/v1/workflows/debate/runs", {"inputs": {"question": "q"}, "config": {"agents": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "config.agents"
    r = post(server, "/v1/workflows/agent/runs", {"inputs": {"question": "q"}, "config": {"actions": ["search"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "config.actions"
    r = post(server, "/v1/workflows/agent/runs", {"inputs": {"question": "q"}, "config": {"actions": ["fly"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "config.actions[0]"


def test_events_stream_of_a_traced_run(server):
    with httpx.stream("POST", f"{server.base_url}/v1/workflows/router/runs", headers=HEADERS, timeout=300,
                      json={"inputs": {"question": "Hi?"}, "config": {"route": "direct", "max_tokens": 4},
                            "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "run.started" and kinds[-1] == "run.finished"
    grew = [e for e in events if e["event"] == "run.grew"]
    assert grew and grew[0]["nodes"] == ["answer.1", "answer.1.prefill"]
    assert {"node.started", "node.finished"} <= set(kinds)
    # The answer's tokens stream as they are written, and make up the answer.
    deltas = [e["delta"] for e in events if e["event"] == "node.partial" and e["node"] == "answer.1"]
    assert deltas and "".join(deltas).strip() == events[-1]["result"]["answer"]


def test_cancel_mid_debate_and_the_graph_so_far(server):
    r = post(server, "/v1/workflows/debate/runs", {"inputs": {"question": "Is a river a road?"},
                                                   "config": {"agents": 2, "rounds": 5, "max_tokens": 8},
                                                   "background": True})
    assert r.status_code == 202, r.text
    run_id = r.json()["id"]
    deadline = time.monotonic() + 240
    while not any(n["state"] == "done" and n["node"].startswith("agent.")
                  for n in get(server, f"/v1/runs/{run_id}").json()["nodes"]):
        assert time.monotonic() < deadline, "no agent answered"
        time.sleep(0.2)
    graph = graph_nodes(server, run_id)  # what has unfolded so far, while it runs
    assert {"agent.1", "agent.2"} <= set(graph)
    cancelled = httpx.delete(f"{server.base_url}/v1/runs/{run_id}", headers=HEADERS, timeout=60).json()
    assert cancelled["status"] == "cancelled"
    assert not any(n["state"] == "running" for n in cancelled["nodes"])
    timeline = get(server, f"/v1/runs/{run_id}/timeline").json()
    assert timeline["status"] == "cancelled" and timeline["nodes"]
