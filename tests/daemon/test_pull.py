"""``headrace pull`` and ``headrace serve`` with ``hf:`` models, each in a process of its own: huggingface_hub finds
the stand-in hub through ``HF_ENDPOINT`` and its cache through ``HF_HOME``, as a user's would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hub_standin import StandInHub, smollm2_repo

from conftest import Server

REPO = "test-org/smollm2-gguf"
Q8_0 = "SmolLM2-135M-Instruct.Q8_0.gguf"


@pytest.fixture
def hub():
    hub = StandInHub({REPO: smollm2_repo()})
    yield hub
    hub.close()


def hub_env(hub: StandInHub, tmp_path: Path, offline: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN")}
    # Online is HF_HUB_OFFLINE=0 rather than unset: set, the daemon leaves it as it is (its default is offline).
    return {**env, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1" if offline else "0"}


def headrace(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headrace.daemon.commands", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def llm_config(tmp_path: Path, model: str) -> Path:
    config = tmp_path / "hf.toml"
    # Few sequences and short contexts: the KV cells llama.cpp allocates stay small.
    config.write_text(f'[[engines]]\nname = "smollm2"\nplugin = "llama-cpp"\nmodel = "{model}"\n\n'
                      '[engines.options]\nquantize = "none"\nthreads = 2\nn_seq_max = 2\nprefix_cache_sequences = 1\n'
                      'max_context_tokens = 512\n\n'
                      '[[engines]]\nname = "store"\nplugin = "lancedb"\n')
    return config


def test_pull_fetches_once_and_prints_the_path(hub, tmp_path):
    env = hub_env(hub, tmp_path)
    first = headrace(env, "pull", f"hf:{REPO}:Q8_0")
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip())
    assert path.name == Q8_0 and path.is_relative_to(tmp_path / "hf" / "hub")
    assert path.read_bytes() == smollm2_repo()[Q8_0]
    assert f"fetching hf:{REPO}:Q8_0 ({Q8_0})" in first.stderr
    again = headrace(env, "pull", f"hf:{REPO}:Q8_0")
    assert again.returncode == 0 and again.stdout == first.stdout
    assert len(hub.downloads(Q8_0)) == 1
    # offline, the cache answers
    assert headrace(hub_env(hub, tmp_path, offline=True), "pull", f"hf:{REPO}:Q8_0").stdout == first.stdout


def test_pull_with_no_model_pulls_the_configs(hub, tmp_path):
    config = llm_config(tmp_path, f"hf:{REPO}:Q8_0")
    pulled = headrace(hub_env(hub, tmp_path), "pull", "--config", str(config))
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).name == Q8_0
    plain = tmp_path / "plain.toml"
    plain.write_text('[[engines]]\nname = "store"\nplugin = "lancedb"\n')
    none = headrace(hub_env(hub, tmp_path), "pull", "--config", str(plain))
    assert none.returncode == 2 and "names no hf: model" in none.stderr


def test_pull_says_what_is_wrong(hub, tmp_path):
    missing = headrace(hub_env(hub, tmp_path, offline=True), "pull", f"hf:{REPO}:Q8_0")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith(f"headrace pull: model: hf:{REPO}:Q8_0 is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE" in missing.stderr
    unknown = headrace(hub_env(hub, tmp_path), "pull", "hf:test-org/nope:Q8_0")
    assert unknown.returncode == 1 and "no model repository test-org/nope" in unknown.stderr
    not_hf = headrace(hub_env(hub, tmp_path), "pull", "models/llm.gguf")
    assert not_hf.returncode == 2 and "'models/llm.gguf' is not an hf: model" in not_hf.stderr


def test_serve_offline_without_the_model_fails_at_once_naming_pull(hub, tmp_path):
    config = llm_config(tmp_path, f"hf:{REPO}:Q4_1")
    served = headrace(hub_env(hub, tmp_path, offline=True), "serve", "--config", str(config), "--port", "0")
    assert served.returncode == 2
    assert served.stderr.strip().splitlines() == [
        f"headrace: engines.smollm2.model: hf:{REPO}:Q4_1 is not in the Hugging Face cache "
        f"({tmp_path / 'hf' / 'hub'}) and HF_HUB_OFFLINE=1 forbids fetching it: run `headrace pull hf:{REPO}:Q4_1` "
        "where HF_HUB_OFFLINE is unset (the same HF_HOME), then start again"]
    assert hub.count() == 0


@pytest.mark.slow
def test_a_daemon_serves_a_model_it_fetched_then_starts_offline_from_the_cache(hub, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")
    config = llm_config(tmp_path, f"hf:{REPO}:Q4_1")
    for offline in (False, True):
        asked = hub.count()
        server = Server(config, tmp_path, env=hub_env(hub, tmp_path, offline=offline))
        try:
            server.wait_ready()
            r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
                "model": "smollm2", "prompt": "A mill wheel turns because", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"].strip()
        finally:
            server.stop()
        log = server.log.read_text()
        if offline:  # the second start: from the cache, not one request to the hub
            assert hub.count() == asked and "fetching" not in log
        else:
            assert f"headrace: fetching hf:{REPO}:Q4_1 (SmolLM2-135M-Instruct.Q4_1.gguf)" in log
    assert len(hub.downloads("SmolLM2-135M-Instruct.Q4_1.gguf")) == 1
