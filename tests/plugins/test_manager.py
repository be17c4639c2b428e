"""Plugin discovery: built-ins by module name, third parties by entry point, the allow-list."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import httpx
import pluggy
import pytest

from conftest import ROOT, Server, in_process
from headrace.plugins import hookspecs
from headrace.plugins.manager import DEFAULT_PLUGINS, PluginError, allowed_entry_points, collect, make_manager

PLUGIN_DIR = ROOT / "plugins-contrib" / "headrace-hashembed"


@pytest.fixture(scope="module")
def hashembed():
    """The example third-party plugin, pip-installed as a user would."""
    try:
        importlib.metadata.distribution("headrace-hashembed")
    except importlib.metadata.PackageNotFoundError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        str(PLUGIN_DIR)], check=True)
    return "hashembed"


def plugins_output(monkeypatch, **env: str) -> str:
    """``headrace plugins`` in this process (no interpreter and torch import of its own), with ``env`` set."""
    from headrace.daemon.commands import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    importlib.invalidate_caches()  # the fixture may have just installed the plugin
    out = in_process(main, "plugins")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_builtins_are_plugins():
    registry = collect(make_manager())
    assert {"torch", "sentence-transformers", "cross-encoder", "llm-rerank", "lancedb"} <= set(registry.engines)
    assert "fifo" in registry.batch_policies
    for module in DEFAULT_PLUGINS:
        assert module in registry.by_plugin


def test_installed_plugin_is_discovered(hashembed, monkeypatch):
    monkeypatch.delenv("HEADRACE_PLUGINS", raising=False)
    out = plugins_output(monkeypatch)
    assert "hashembed\n  register_engines: hash-embed" in out
    assert "headrace.plugins.engines.torch_engine.engine\n  register_engines: torch" in out


def test_allow_list(hashembed, monkeypatch):
    importlib.invalidate_caches()  # the fixture may have just installed it

    def allowed(value: str) -> set[str]:
        monkeypatch.setenv("HEADRACE_PLUGINS", value)
        return {ep.name for ep in allowed_entry_points()}

    assert "hashembed" in allowed("other, hashembed")
    assert "hashembed" not in allowed("other")
    assert "hashembed" not in allowed("")
    # Built-ins load whatever the allow-list says (still set to none here), and so does the CLI.
    assert {"torch", "lancedb"} <= set(collect(make_manager()).engines)
    out = plugins_output(monkeypatch, HEADRACE_PLUGINS="")
    assert "hashembed" not in out and "register_engines: torch" in out


def test_duplicate_registration_names_the_plugin():
    class Again:
        @hookspecs.hookimpl
        def register_batch_policies(self, register):
            register("fifo", object)

    pm = make_manager()
    pm.register(Again(), name="again")
    with pytest.raises(PluginError, match="again: register_batch_policies name 'fifo' is already registered"):
        collect(pm)


@pytest.mark.slow
def test_installed_plugin_engine_is_served(hashembed, tmp_path):
    config = tmp_path / "hash.toml"
    config.write_text('[[engines]]\nname = "hash"\nplugin = "hash-embed"\n[engines.options]\ndimensions = 32\n')
    server = Server(config, tmp_path).wait_ready(60)
    try:
        r = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": "hash", "input": ["a river", "a mill"]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == 2 and len(data[0]["embedding"]) == 32
        assert data[0]["embedding"] != data[1]["embedding"]
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert [(m["id"], m["plugin"]) for m in models] == [("hash", "hash-embed")]
    finally:
        server.stop()


def test_pluggy_is_only_used_at_startup():
    # The registry is plain dicts of factories: the request path never calls a hook.
    registry = collect()
    assert all(not isinstance(f, pluggy.HookCaller) for f in registry.engines.values())
