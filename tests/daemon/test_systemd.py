"""Under systemd: the notify protocol on a real socket, and a watchdog that a wedged engine silences."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from conftest import ROOT, Server

WATCHDOG_USEC = 1_000_000  # a ping every half second; the workers get that long to answer


def test_notify_reaches_an_abstract_socket(monkeypatch):
    from headrace.daemon import systemd

    name = f"headrace-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind("\0" + name)
        notify.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify("STATUS=hello")
        assert notify.recv(256) == b"STATUS=hello"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not systemd.notify("READY=1")  # not under systemd: nothing to tell


class Listener:
    """The socket systemd would read: every datagram the daemon sends, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.heard: list[str] = []

    def until(self, state: str, timeout: float) -> list[str]:
        """Datagrams up to and including ``state``."""
        deadline = time.monotonic() + timeout
        got: list[str] = []
        while state not in got:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                got.append(self.sock.recv(512).decode())
            except socket.timeout:
                raise AssertionError(f"no {state} within {timeout}s; heard {got}") from None
        self.heard += got
        return got

    def during(self, seconds: float) -> list[str]:
        """Everything heard in the next ``seconds``."""
        deadline, got = time.monotonic() + seconds, []
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                got.append(self.sock.recv(512).decode())
            except socket.timeout:
                break
        self.heard += got
        return got


@contextmanager
def wedged(obj, method: str):
    """Make ``obj.method`` block its thread until the block ends (then it runs as before); yields
    the event set once a call is stuck in it."""
    entered, release = threading.Event(), threading.Event()
    original = getattr(obj, method)

    def stuck(*args):
        entered.set()
        release.wait(120)
        return original(*args)

    setattr(obj, method, stuck)
    try:
        yield entered
    finally:
        delattr(obj, method)  # the class's own method again
        release.set()


def assert_silent_while_wedged(systemd: Listener, client: TestClient, engine: str) -> None:
    systemd.during(WATCHDOG_USEC / 1e6)  # a ping already on its way may still land
    assert "WATCHDOG=1" not in systemd.during(2 * WATCHDOG_USEC / 1e6), f"pinged while {engine} is wedged"
    health = client.get("/health")
    assert health.status_code == 503 and engine in health.json()["problems"], health.text


@pytest.mark.slow
def test_watchdog_pings_stop_while_an_engine_thread_is_wedged(tmp_path, monkeypatch):
    from headrace.daemon.app import create_app
    from headrace.daemon.config import load_config

    config = load_config(ROOT / "configs" / "default.toml", env={}, overrides={"data.dir": str(tmp_path / "data")})
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify.sock"))
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
        monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
        systemd = Listener(sock)
        app = create_app(config)
        with TestClient(app) as client:  # the real app and lifespan: every engine loads on its own thread
            loading = systemd.until("READY=1", 300)
            statuses = [s for s in loading if s.startswith("STATUS=")]
            assert statuses[0] == "STATUS=loading smollm2 (llama-cpp): 0 of 4 engines loaded"
            assert "STATUS=loading lancedb (lancedb): 3 of 4 engines loaded" in statuses
            assert statuses[-1] == "STATUS=4 of 4 engines loaded; ready"
            assert systemd.during(3.5).count("WATCHDOG=1") >= 2  # alive: a ping every half second

            # Wedge the LLM's engine thread inside an iteration, as a forward pass that never returns would.
            core = app.state.services.daemon.pool.slots["smollm2"].engine.core
            with wedged(core, "step") as entered:
                # Any iteration wedges it: a chat on its way in, or the watchdog's own heartbeat.
                assert entered.wait(10), "the engine thread never iterated"
                assert_silent_while_wedged(systemd, client, "smollm2")
            systemd.until("WATCHDOG=1", 10)  # unwedged: alive again
            assert client.get("/health").status_code == 200
            chat = client.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 4, "temperature": 0,
                                                              "messages": [{"role": "user", "content": "Hi"}]})
            assert chat.status_code == 200, chat.text

            # A batchable engine: its batch runs on a worker thread and never comes back.
            embedder = app.state.services.daemon.pool.slots["all-minilm-l6-v2"].engine
            with ThreadPoolExecutor(1) as pool:
                with wedged(embedder, "_encode") as entered:
                    embedded = pool.submit(client.post, "/v1/embeddings",
                                           json={"model": "all-minilm-l6-v2", "input": "a mill wheel"})
                    assert entered.wait(30), "the embedding batch never started"
                    assert_silent_while_wedged(systemd, client, "all-minilm-l6-v2")
                assert embedded.result(60).status_code == 200
            systemd.until("WATCHDOG=1", 10)
        assert "STOPPING=1" in systemd.during(0.5)  # the lifespan ended


# A tqdm bar ("42%|####  | 5/12 [00:01<00:02, 3.1it/s]") and Python's warning lines.
PROGRESS_BAR = re.compile(r"\d+%\|| \d+/\d+ \[\d\d:\d\d|it/s\]")
WARNING_LINE = re.compile(r"FutureWarning|DeprecationWarning|UserWarning|warnings\.warn")


@pytest.mark.slow
def test_model_loading_logs_one_line_per_engine_and_no_library_noise(tmp_path):
    # A fresh cache: the GGUF is converted again, the load that once drew transformers' bars.
    server = Server(ROOT / "configs" / "default.toml", tmp_path,
                    env={"HEADRACE_DATA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": ""})
    try:
        server.wait_ready()
        # A forward pass too: that is where transformers warns of its deprecated arguments.
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200, chat.text
    finally:
        server.stop()
    log = server.log.read_text()
    for engine, plugin in (("smollm2", "llama-cpp"), ("all-minilm-l6-v2", "sentence-transformers"),
                           ("smollm2-rerank", "llm-rerank"), ("lancedb", "lancedb")):
        assert len(re.findall(rf"loading {engine} \({re.escape(plugin)}\) \.\.\.$", log, re.M)) == 1, log
        assert len(re.findall(rf"loaded {engine} in \d+\.\d s( \(.* by (its tensors|RSS growth)\))?$", log, re.M)) == 1, log
    assert not PROGRESS_BAR.search(log), log
    assert not WARNING_LINE.search(log), log


# ----- the unit ----------------------------------------------------------------------------------

HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
             "UMask": "0077", "StateDirectory": "headrace", "CacheDirectory": "headrace",
             "StateDirectoryMode": "0700", "RestrictSUIDSGID": "yes"}


def unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_the_shipped_unit_is_the_one_headrace_writes():
    from headrace.daemon import systemd

    assert (ROOT / "configs" / "headrace.service").read_text() == systemd.unit()


@pytest.mark.parametrize("user", [None, "headrace"])
def test_the_unit_is_hardened_and_runs_as_a_dedicated_user(user):
    from headrace.daemon import systemd

    settings = unit_settings(systemd.unit(user, "/opt/headrace/bin/headrace", "/etc/headrace/h.toml"))
    assert {k: settings.get(k) for k in HARDENING} == {k: [v] for k, v in HARDENING.items()}
    if user is None:
        assert settings["DynamicUser"] == ["yes"] and "User" not in settings
    else:
        assert settings["User"] == settings["Group"] == [user] and "DynamicUser" not in settings
    assert settings["ExecStart"] == ["/opt/headrace/bin/headrace serve --config /etc/headrace/h.toml"]
    # ProtectSystem=strict leaves only these writable: the data and cache dirs must be them.
    assert settings["Environment"][:2] == ["HEADRACE_DATA_DIR=%S/headrace", "HEADRACE_DATA_CACHE_DIR=%C/headrace"]


@pytest.mark.parametrize("bad", [{"user": "Root User"}, {"user": "x;rm"}, {"exec_start": "/opt/my headrace"},
                                 {"config": "/etc/%h.toml"}, {"exec_start": ""}])
def test_a_unit_of_a_bad_user_or_path_is_refused(bad):
    from headrace.daemon import systemd

    with pytest.raises(ValueError):
        systemd.unit(**bad)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: apt-get install systemd)")
@pytest.mark.parametrize("user", [None, "headrace"])
def test_systemd_analyze_verifies_the_unit(tmp_path, user):
    from headrace.daemon import systemd

    headrace = Path(sys.executable).parent / "headrace"  # verify checks that ExecStart's binary is executable
    unit = tmp_path / "headrace.service"
    unit.write_text(systemd.unit(user, str(headrace)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # An unknown or misspelt key is only a warning (exit 0): any line about our file fails too.
    about_ours = [line for line in (r.stdout + r.stderr).splitlines() if unit.name in line]
    assert r.returncode == 0 and not about_ours, r.stdout + r.stderr
