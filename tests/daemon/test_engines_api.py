"""PATCH /v1/engines/{name} on the real server, and a plain chat reusing the prefix cache."""

from __future__ import annotations

import httpx
import pytest

from conftest import API_KEY, metric_value

pytestmark = pytest.mark.slow

SYSTEM = " ".join(f"Rule {i}: answer about mills, wheels and the water that turns them." for i in range(40))


def client(server) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)


def chat(c: httpx.Client, question: str) -> str:
    r = c.post("/v1/chat/completions", json={
        "model": "smollm2", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_llm_policy_changes_on_a_live_engine(server):
    with client(server) as c:
        try:
            r = c.patch("/v1/engines/smollm2", json={"llm_policy": "topology"})
            assert r.status_code == 200, r.text
            assert r.json() == {"id": "smollm2", "object": "engine.settings", "kind": "llm",
                                "llm_policy": "topology", "prefix_caching": True, "max_runs": 0, "retention": True,
                                "prefix_cache_tokens": 16384, "prefix_cache_pin_tokens": 4096}
            chat(c, "Does the wheel turn?")  # still serves
            r = c.patch("/v1/engines/smollm2", json={"max_runs": 1})
            assert r.status_code == 200 and r.json()["max_runs"] == 1 and r.json()["llm_policy"] == "topology"
            chat(c, "Does the wheel turn?")  # one run at a time: a chat is a run, it is let in
        finally:
            r = c.patch("/v1/engines/smollm2", json={"llm_policy": "fifo", "max_runs": 0})
            assert (r.json()["llm_policy"], r.json()["max_runs"]) == ("fifo", 0)


@pytest.mark.parametrize(("name", "body", "status", "param"), [
    ("smollm2", {"llm_policy": "shortest-first"}, 400, "llm_policy"),
    ("all-minilm-l6-v2", {"llm_policy": "topology"}, 400, "llm_policy"),
    ("all-minilm-l6-v2", {"prefix_caching": False}, 400, "prefix_caching"),
    ("smollm2", {"prefix_caching": "no"}, 400, "prefix_caching"),
    ("smollm2", {"max_runs": -1}, 400, "max_runs"),
    ("smollm2", {"retention": "off"}, 400, "retention"),
    ("all-minilm-l6-v2", {"max_runs": 2}, 400, "max_runs"),
    ("all-minilm-l6-v2", {"prefix_cache_tokens": 1024}, 400, "prefix_cache_tokens"),
    ("smollm2", {"prefix_cache_tokens": 0}, 400, "prefix_cache_tokens"),
    ("smollm2", {"prefix_cache_tokens": 1024, "prefix_cache_pin_tokens": 2048}, 400, "prefix_cache_pin_tokens"),
    ("smollm2", {"prefix_cache_pin_tokens": 20000}, 400, "prefix_cache_pin_tokens"),
    ("smollm2", {"llm_policy": "fifo", "speed": 2}, 400, "speed"),
    ("nope", {"llm_policy": "fifo"}, 404, "engine"),
])
def test_bad_settings_are_refused_and_change_nothing(server, name, body, status, param):
    with client(server) as c:
        r = c.patch(f"/v1/engines/{name}", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        settings = c.patch("/v1/engines/smollm2", json={}).json()
        assert (settings["llm_policy"], settings["max_runs"]) == ("fifo", 0)
        assert (settings["prefix_cache_tokens"], settings["prefix_cache_pin_tokens"]) == (16384, 4096)


def test_a_plain_chat_reuses_a_cached_system_prompt_and_caching_switches_off(server):
    with client(server) as c:
        chat(c, "Which way does the wheel turn?")
        hits = metric_value(server.metrics(), "headrace_prefix_cache_hits_total", model="smollm2")
        chat(c, "What carries the water?")
        after = metric_value(server.metrics(), "headrace_prefix_cache_hits_total", model="smollm2")
        assert after - hits >= 400  # the system prompt, to its last whole block
        try:
            assert c.patch("/v1/engines/smollm2", json={"prefix_caching": False}).json()["prefix_caching"] is False
            chat(c, "What carries the water?")
            assert metric_value(server.metrics(), "headrace_prefix_cache_hits_total", model="smollm2") == after
        finally:
            assert c.patch("/v1/engines/smollm2", json={"prefix_caching": True}).json()["prefix_caching"] is True
        assert metric_value(server.metrics(), "headrace_prefix_cache_queries_total", model="smollm2") > after


def test_the_prefix_cache_budget_changes_on_a_live_engine_and_back(server):
    with client(server) as c:
        try:
            r = c.patch("/v1/engines/smollm2", json={"prefix_cache_tokens": 256})
            assert r.status_code == 200, r.text
            # The pins keep the configured share (4,096 of 16,384); the gauge's capacity is the new budget.
            assert (r.json()["prefix_cache_tokens"], r.json()["prefix_cache_pin_tokens"]) == (256, 64)
            assert r.json()["prefix_caching"] is True
            chat(c, "Which way does the wheel turn?")
            hits = metric_value(server.metrics(), "headrace_prefix_cache_hits_total", model="smollm2")
            chat(c, "What carries the water?")
            # The system prompt (over 400 tokens) no longer fits: nothing of it is found again.
            assert metric_value(server.metrics(), "headrace_prefix_cache_hits_total", model="smollm2") == hits
            r = c.patch("/v1/engines/smollm2", json={"prefix_cache_pin_tokens": 256})
            assert (r.json()["prefix_cache_tokens"], r.json()["prefix_cache_pin_tokens"]) == (256, 256)
        finally:  # the configured budgets again (the test above finds the system prompt cached with them)
            r = c.patch("/v1/engines/smollm2", json={"prefix_cache_tokens": 16384, "prefix_cache_pin_tokens": 4096})
            assert (r.json()["prefix_cache_tokens"], r.json()["prefix_cache_pin_tokens"]) == (16384, 4096)
