"""A program's KV kept across its tool calls, clients' cache_control pins, and their /metrics (issue 28 items
3-5), on the default config's llama-cpp engine (the shared daemon): token counts, never timings."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from conftest import metric_value
from headrace.plugins.engines.llama_cpp.options import DEFAULT_CACHE_SEQUENCES

MODEL = "smollm2"
TOOL = {"type": "function", "function": {"name": "look_up", "description": "Look the order up.",
                                         "parameters": {"type": "object", "properties": {}}}}
FORCED = {"type": "function", "function": {"name": "look_up"}}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {server.api_key}"})


def cache(server, name: str, **labels: str) -> float:
    return metric_value(server.metrics(), f"headrace_prefix_cache_{name}", model=MODEL, **labels)


def system_prompt(tag: object, rules: int = 40) -> str:
    """~15 tokens a rule, its own: no other prompt shares more than the chat template's first block."""
    return f"Case {tag}. " + " ".join(f"Rule {i} of desk {tag}: answer the customer politely." for i in range(rules))


def restored(server) -> float:
    """Prompt tokens the KV tiers below the cells restored so far (issue 42: host memory, disk)."""
    text = server.metrics()
    return sum(metric_value(text, "headrace_kv_tier_hit_tokens_total", model=MODEL, tier=t) for t in ("host", "disk"))


def agent_turns(server, key: str | None, retained: bool = True) -> tuple[int, float, float]:
    """An agent's two turns (the first forced to call the tool) with unrelated traffic between them that
    fills the prefix cache many times over; the first turn's prompt tokens, the second turn's hits (the cells'
    or the KV tiers'), and of those, the tokens a tier restored (a context evicted from the cells)."""
    tag = uuid.uuid4().hex[:8]
    messages = [{"role": "system", "content": system_prompt(tag, rules=8)},
                {"role": "user", "content": "Where is order 7?"}]
    program = {"prompt_cache_key": key} if key else {}
    first = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": [TOOL],
                                                  "tool_choice": FORCED, "temperature": 0, "max_tokens": 48,
                                                  **program})
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    if key and retained:
        assert cache(server, "pinned_tokens") >= first.json()["usage"]["prompt_tokens"] // 16 * 16
    for i in range(DEFAULT_CACHE_SEQUENCES + 4):  # unrelated prompts, each a cache entry of its own: more than the
        # cells hold
        other = post(server, "/v1/completions", {"model": MODEL, "max_tokens": 2, "temperature": 0,
                                                 "prompt": f"Note {tag}-{i}: {system_prompt(i, rules=2)}"})
        assert other.status_code == 200, other.text
    call = choice["message"]["tool_calls"][0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "Order 7 left on Monday."}]
    hits, tiers = cache(server, "hits_total"), restored(server)
    second = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": [TOOL],
                                                   "temperature": 0, "max_tokens": 4, **program})
    assert second.status_code == 200, second.text
    return first.json()["usage"]["prompt_tokens"], cache(server, "hits_total") - hits, restored(server) - tiers


def test_a_tool_call_turns_kv_outlives_traffic_that_evicts_it_under_lru(server):
    prompt, hits, tiers = agent_turns(server, key=None)  # no program: plain LRU, the context left the cells
    assert hits - tiers < 64, (hits, tiers)  # from the cells: the chat template's opening at most
    assert tiers >= prompt // 16 * 16 - 16, (prompt, tiers)  # the KV tiers had kept its prompt
    prompt, hits, tiers = agent_turns(server, key=f"agent-{uuid.uuid4().hex}")
    # The whole first prompt but the block where its end meets the call the model wrote (tokenized afresh),
    # from the cells: the pin held the context there.
    assert hits >= prompt // 16 * 16 - 16 and tiers == 0, (prompt, hits, tiers)
    assert cache(server, "evictions_total", reason="superseded") > 0  # each prompt's entry gave way to its output's


def continued(server, program: dict) -> tuple[int, float]:
    """A completion that goes on counting for 48 tokens, then a plain prompt repeating it and its output: the
    first's prompt tokens, and the prefix-cache hits of the second."""
    prompt = f"Note {uuid.uuid4().hex[:8]}: " + system_prompt(uuid.uuid4().hex[:8], rules=4)
    first = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0,
                                             **program})
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 48, first.json()  # it goes on with the rules
    hits = cache(server, "hits_total")
    second = post(server, "/v1/completions", {"model": MODEL, "max_tokens": 1, "temperature": 0,
                                              "prompt": prompt + first.json()["choices"][0]["text"]})
    assert second.status_code == 200, second.text
    return first.json()["usage"]["prompt_tokens"], cache(server, "hits_total") - hits


def test_a_finished_requests_prompt_and_output_stay_cached(server):
    """As llama-server's slot keeps its last exchange: a request's prompt and output stay cached whether it named a
    program or not, so the next turn that repeats them both finds them."""
    for program in ({}, {"user": f"agent-{uuid.uuid4().hex}"}):
        prompt, hits = continued(server, program)
        # Past the prompt, into the output (where they meet, tokenized afresh, may cost a block).
        assert hits >= prompt // 16 * 16 + 16, (program, prompt, hits)


def pin_marked(server, ttl, rules: int) -> httpx.Response:
    system = {"role": "system", "content": system_prompt(uuid.uuid4().hex[:8], rules=rules),
              "cache_control": {"type": "ephemeral", "ttl": ttl}}
    return post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "temperature": 0,
                                                 "messages": [system, {"role": "user", "content": "Hi"}]})


def test_a_cache_control_pin_expires_and_pins_stay_within_their_budget(server):
    # A pin budget of 1,024 tokens for this test (configs/default.toml's 4,096 put back after): pins of ~420
    # tokens fill it, where the configured budget took three ~1,500-token prompts, each prefilled in full.
    budget = 1024
    r = patch_engine(server, MODEL, {"prefix_cache_pin_tokens": budget})
    assert r.status_code == 200 and r.json()["prefix_cache_pin_tokens"] == budget, r.text
    try:
        pinned, expired = cache(server, "pinned_tokens"), cache(server, "pins_total", outcome="expired")
        assert pin_marked(server, 1, rules=8).status_code == 200
        assert cache(server, "pinned_tokens") > pinned  # the marked prefix's entry is held
        time.sleep(1.5)  # past its TTL: the next lookup unpins it
        for _ in range(3):  # ~420 tokens each (500 at 24 rules): the budget holds two at most, refuses the third
            assert pin_marked(server, "5m", rules=20).status_code == 200
            assert cache(server, "pinned_tokens") <= budget
        assert cache(server, "pins_total", outcome="refused") > 0
        assert cache(server, "pins_total", outcome="expired") > expired  # the 1-second pin ran out meanwhile, lazily
    finally:
        r = patch_engine(server, MODEL, {"prefix_cache_tokens": 16384, "prefix_cache_pin_tokens": 4096})
        assert (r.json()["prefix_cache_tokens"], r.json()["prefix_cache_pin_tokens"]) == (16384, 4096), r.text


@pytest.mark.parametrize("mark, param", [
    ({"type": "persistent"}, "messages[0].cache_control.type"),
    ({"type": "ephemeral", "ttl": "2h"}, "messages[0].cache_control.ttl"),
    ({"type": "ephemeral", "ttl": -5}, "messages[0].cache_control.ttl"),
    ({"type": "ephemeral", "ttl": 7200}, "messages[0].cache_control.ttl"),
    ({"type": "ephemeral", "ttl": True}, "messages[0].cache_control.ttl"),
    ({"type": "ephemeral", "scope": "global"}, "messages[0].cache_control.scope"),
])
def test_a_bad_cache_control_is_400_with_the_envelope(server, mark, param):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "Hi", "cache_control": mark}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_a_bad_cache_control_on_a_content_part_is_400_naming_the_part(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": 0}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].cache_control.ttl", r.text


def test_a_bad_prompt_cache_key_is_400_with_the_envelope(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "prompt_cache_key": ["a"], "messages": [
        {"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", r.text


def patch_engine(server, name: str, body: dict) -> httpx.Response:
    return httpx.patch(f"{server.base_url}/v1/engines/{name}", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {server.api_key}"})


def test_retention_switched_off_serves_a_program_as_lru_does_and_only_pin_engines_take_the_switch(server):
    assert patch_engine(server, MODEL, {"retention": False}).json()["retention"] is False
    try:
        prompt, hits, tiers = agent_turns(server, key=f"agent-{uuid.uuid4().hex}", retained=False)
        assert hits - tiers < 64, (prompt, hits, tiers)  # a named program, but nothing pinned: evicted as under LRU
    finally:
        assert patch_engine(server, MODEL, {"retention": True}).json()["retention"] is True
    r = patch_engine(server, "all-minilm-l6-v2", {"retention": True})  # the default config's embedder
    assert r.status_code == 400 and r.json()["error"]["param"] == "retention", r.text
