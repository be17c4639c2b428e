"""The run history's byte budget over HTTP: a run kept as a summary says ``details_dropped``, keeps its record and
timeline, and the routes that need what went (graph, events) answer 410 in the error envelope.

In-process app, no engines: the runs are a traced workflow of calculator calls with a 65 KB input.
"""

from __future__ import annotations

import pytest
from conftest import metric_value
from starlette.testclient import TestClient

from headrace.daemon.app import create_app
from headrace.daemon.config import load_config
from headrace.graph.workflow import Workflow

TEXT = "The headrace carries the water from the river to the mill wheel. " * 1000


async def sums(t):
    first, second = t.tool("calculator", "1 + 2"), t.tool("calculator", "3 * 4")
    return {"answer": [await first, await second]}


@pytest.fixture
def app_client(tmp_path):
    """The app with a 0.2 MiB run history (two or three of these runs with their details) and the offline workflow."""
    config = load_config(None, env={}, overrides={"data.dir": str(tmp_path), "workflows.run_history_mib": 0.2})
    app = create_app(config)
    with TestClient(app) as client:
        workflows = app.state.services.daemon.workflows
        workflows.workflows["sums"] = Workflow("sums", "calculator calls", {"text": {"type": "string"}}, trace=sums,
                                               outputs=("answer",), kinds=())
        yield app, client


def test_old_runs_say_details_dropped_keep_their_record_and_their_graph_and_events_are_410(app_client):
    app, client = app_client
    workflows = app.state.services.daemon.workflows
    assert workflows.history.budget_bytes == int(0.2 * 2**20)
    runs = [client.portal.call(workflows.run, "sums", {"text": f"{i} {TEXT}"}) for i in range(6)]
    assert workflows.history.total_bytes <= workflows.history.budget_bytes
    records = [client.get(f"/v1/runs/{run.id}").json() for run in runs]
    dropped = [record["details_dropped"] for record in records]
    assert dropped[0] and not dropped[-1] and dropped == sorted(dropped, reverse=True), dropped  # oldest first
    for record in records:  # a summary keeps what the record shows
        assert record["status"] == "succeeded" and record["result"] == {"answer": ["3", "12"]}
        assert [n["node"] for n in record["nodes"]] == ["calculator.1", "calculator.2"]
    listed = client.get("/v1/runs").json()["data"]
    assert [r["details_dropped"] for r in listed] == dropped[::-1]  # newest first
    old, new = runs[0].id, runs[-1].id
    for suffix, what in (("/graph", "graph"), ("/graph?format=dot", "graph"), ("/events", "events")):
        r = client.get(f"/v1/runs/{old}{suffix}")
        assert r.status_code == 410, (suffix, r.text)
        error = r.json()["error"]
        assert error["code"] == "run_details_dropped" and error["param"] == "run_id" and error["type"]
        assert old in error["message"] and what in error["message"] and "run_history_mib" in error["message"]
    timeline = client.get(f"/v1/runs/{old}/timeline")
    assert timeline.status_code == 200 and [n["node"] for n in timeline.json()["nodes"]] == ["calculator.1",
                                                                                           "calculator.2"]
    graph = client.get(f"/v1/runs/{new}/graph")
    assert graph.status_code == 200 and set(n["id"] for n in graph.json()["graph"]["nodes"]) == {"calculator.1",
                                                                                                "calculator.2"}
    with client.stream("GET", f"/v1/runs/{new}/events") as events:
        assert events.status_code == 200 and "run.finished" in events.read().decode()
    r = client.delete(f"/v1/runs/{old}")  # cancelling a summary is the no-op it is for any finished run
    assert r.status_code == 200 and r.json()["details_dropped"] is True


def test_metrics_say_what_the_kept_runs_hold_and_how_many_lost_their_details(app_client):
    app, client = app_client
    workflows = app.state.services.daemon.workflows
    before = client.get("/metrics").text
    assert metric_value(before, "headrace_run_history_bytes") == 0
    assert metric_value(before, "headrace_run_history_budget_bytes") == int(0.2 * 2**20)
    for i in range(6):
        client.portal.call(workflows.run, "sums", {"text": f"{i} {TEXT}"})
    text = client.get("/metrics").text
    held = metric_value(text, "headrace_run_history_bytes")
    assert held == workflows.history.total_bytes and 0 < held <= int(0.2 * 2**20)
    kept = metric_value(text, "headrace_run_history_runs", details="kept")
    dropped = metric_value(text, "headrace_run_history_runs", details="dropped")
    records = [client.get(f"/v1/runs/{run_id}").json() for run_id in list(workflows.runs)]
    assert dropped == sum(r["details_dropped"] for r in records) >= 1
    assert kept == len(records) - dropped >= 1


def test_a_packed_run_answers_every_route_as_it_did_live(tmp_path):
    config = load_config(None, env={}, overrides={"data.dir": str(tmp_path)})
    app = create_app(config)
    with TestClient(app) as client:
        workflows = app.state.services.daemon.workflows
        workflows.workflows["sums"] = Workflow("sums", "calculator calls", {"text": {"type": "string"}}, trace=sums,
                                               outputs=("answer",), kinds=())
        workflows.history.live_finished = 1
        routes = ("", "/graph", "/graph?format=dot", "/timeline")
        first = client.portal.call(workflows.run, "sums", {"text": TEXT})
        live = {route: client.get(f"/v1/runs/{first.id}{route}") for route in routes}
        client.portal.call(workflows.run, "sums", {"text": TEXT})
        assert first.packed is not None and not first.graph.nodes  # the second run's finish packed the first
        for route in routes:
            packed = client.get(f"/v1/runs/{first.id}{route}")
            assert packed.status_code == live[route].status_code == 200, (route, packed.text)
            if route == "/timeline":  # the engines' batches are read anew; the run's own part is as it was
                assert packed.json()["nodes"] == live[route].json()["nodes"]
            else:
                assert packed.content == live[route].content, route
        assert client.get(f"/v1/runs/{first.id}").json()["nodes"][0]["node"] == "calculator.1"
