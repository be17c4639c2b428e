"""The daemon under test: one the harness starts itself, or one already running; runs over HTTP."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx


class BenchError(RuntimeError):
    """The harness cannot go on; the message says why."""

def poll_ready(url: str, exited: Callable[[], bool], timeout: float) -> bool | None:
    """Poll a starting server's readiness ``url`` (headrace's ``/ready``, llama-server's ``/health``): True once it
    answers 200, None if ``exited()`` says its process ended, False after ``timeout`` seconds. One client for every poll: each ``httpx.get`` builds an SSL
    context (~58 ms of CPU on the 2-core dev box), taken from the daemon that is starting."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as http:
        while time.monotonic() < deadline:
            if exited():
                return None
            try:
                if http.get(url).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
    return False


def dies_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a daemon this process starts: Linux sends the child SIGTERM when this process dies
    (``PR_SET_PDEATHSIG``), so a crashed test worker or benchmark leaves no daemon holding memory and cores.
    Only from the main thread, whose end is the process's (the signal follows the thread that forked); None
    elsewhere."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # bound before the fork: the child only calls it
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return preexec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """``headrace serve`` with ``config`` on a free local port, in its own data dir, until closed; run by ``python``
    (another venv's interpreter: the agents benchmark's ``vllm`` mode serves from ``.venv-vllm``)."""

    def __init__(self, config: Path, api_key: str = "bench-key", log: Path | None = None,
                 python: str | Path = sys.executable) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="headrace-bench-")
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = log or Path(self._tmp.name) / "daemon.log"
        args = [str(python), "-m", "headrace.daemon.commands", "serve", "--config", str(config), "--port",
                str(self.port), "--data-dir", str(Path(self._tmp.name) / "data"), "--api-key", api_key,
                "--log-level", "warning"]
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=dies_with_this_process())

    def wait_ready(self, timeout: float = 600) -> "DaemonProcess":
        ready = poll_ready(f"{self.base_url}/ready", lambda: self.proc.poll() is not None, timeout)
        if ready is None:
            raise BenchError(f"the daemon exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        if not ready:
            raise BenchError(f"the daemon was not ready after {timeout:.0f}s; log: {self.log}")
        return self

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log_file.close()
        self._tmp.cleanup()


@dataclass
class RunResult:
    latency_s: float  # client-side: request sent to response read
    result: dict[str, Any]
    run_id: str | None = None  # headrace runs: their record on the daemon
    server_s: float | None = None  # headrace runs: the executor's own time


class Daemon:
    """The HTTP side of one daemon: workflow runs, their timelines and graphs, the model list."""

    def __init__(self, base_url: str, api_key: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.last_ingest: dict[str, Any] = {}  # the last index_collection's answer (chunk_kv's work, if any)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a run under load may queue for minutes; the harness bounds it itself.
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                      timeout=httpx.Timeout(None, connect=10),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def models(self) -> dict[str, str]:
        """Model id -> kind, from /v1/models."""
        return {m["id"]: m.get("kind", "") for m in await self.model_list()}

    async def model_list(self) -> list[dict[str, Any]]:
        """/v1/models' entries: each model's id, kind, engine plugin and state."""
        return (await self._json("GET", "/v1/models"))["data"]

    async def run(self, workflow: str, inputs: dict[str, Any], config: dict[str, Any]) -> RunResult:
        t0 = time.perf_counter()
        body = await self._json("POST", f"/v1/workflows/{workflow}/runs", json={"inputs": inputs, "config": config})
        latency = time.perf_counter() - t0
        if body["status"] != "succeeded":
            raise BenchError(f"{workflow} run {body['id']} {body['status']}: {body.get('error')}")
        return RunResult(latency, body["result"], body["id"], body["seconds"])

    async def timeline(self, run_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/runs/{run_id}/timeline")

    async def graph(self, run_id: str) -> dict[str, Any]:
        return (await self._json("GET", f"/v1/runs/{run_id}/graph"))["graph"]

    async def engine_settings(self, engine: str, **changes: Any) -> dict[str, Any]:
        """PATCH /v1/engines/{engine}: apply ``changes`` (none: just read), return the settings in force."""
        return await self._json("PATCH", f"/v1/engines/{engine}", json=changes)

    async def chat_stream(self, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float]:
        """A streamed greedy chat completion: (time to first token, end-to-end latency) in seconds."""
        t0 = time.perf_counter()
        ttft = None
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code >= 400:
                raise BenchError(f"chat: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise BenchError(f"chat stream failed: {event['error']}")
                choices = event.get("choices") or [{}]
                if ttft is None and choices[0].get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
        latency = time.perf_counter() - t0
        return (latency if ttft is None else ttft), latency

    async def index_collection(self, name: str, documents: list[str], chunk_size: int, chunk_overlap: int,
                               **settings: Any) -> int:
        """(Re)create the persistent collection ``name`` over ``documents`` (``settings``: more of its creation's
        fields, ``chunk_kv``); returns its chunk count. The ingest's answer is kept in ``last_ingest``."""
        response = await self.http.delete(f"/v1/collections/{name}")
        if response.status_code not in (200, 404):
            raise BenchError(f"DELETE /v1/collections/{name}: HTTP {response.status_code}: {response.text[:500]}")
        await self._json("POST", "/v1/collections", json={"name": name, "chunk_size": chunk_size,
                                                           "chunk_overlap": chunk_overlap, **settings})
        added = await self._json("POST", f"/v1/collections/{name}/documents",
                                 json={"documents": [{"id": f"doc-{i}", "text": d} for i, d in enumerate(documents)]})
        self.last_ingest = added
        return added["chunks"]

    async def metrics(self) -> str:
        response = await self.http.get("/metrics")
        response.raise_for_status()
        return response.text

    async def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        response = await self.http.request(method, path, **kw)
        if response.status_code >= 400:
            raise BenchError(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()
