"""The KV tiers through the daemon (issue 42): a chat whose prefix left the cells is served from host memory,
its usage counts those tokens as cached, and /metrics shows the tier. (A restart finding the prefixes on disk,
and bad files dropped, are tested on the engine: tests/plugins/test_llama_cpp_tiers.py.)"""

from __future__ import annotations

import httpx

from conftest import API_KEY, metric_value
from headrace.plugins.engines.llama_cpp.options import DEFAULT_CACHE_SEQUENCES

LLM = "smollm2"
CACHE_SEQUENCES = DEFAULT_CACHE_SEQUENCES  # the default config's prefix_cache_sequences


def chat(server, topic: str) -> dict:
    system = " ".join(f"Record {i} of the {topic}: inspected, and found in order." for i in range(25))
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300,
                   headers={"Authorization": f"Bearer {API_KEY}"}, json={
                       "model": LLM, "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": "What was inspected?"}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefix_evicted_from_the_cells_is_restored_from_host_memory_and_counted(server):
    hits = metric_value(server.metrics(), "headrace_kv_tier_hit_tokens_total", model=LLM, tier="host")
    mill = chat(server, "mill")
    for i in range(CACHE_SEQUENCES):  # as many other prefixes as the cells cache: the mill's leaves them
        chat(server, f"sluice gate {i}")
    again = chat(server, "mill")
    metrics = server.metrics()
    prompt, restored = mill["usage"]["prompt_tokens"], (mill["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == restored
    assert again["choices"][0]["message"] == mill["choices"][0]["message"]
    assert metric_value(metrics, "headrace_kv_tier_hit_tokens_total", model=LLM, tier="host") - hits == restored
    assert 0 < metric_value(metrics, "headrace_kv_tier_bytes", model=LLM, tier="host") <= \
        metric_value(metrics, "headrace_kv_tier_capacity_bytes", model=LLM, tier="host")
    assert metric_value(metrics, "headrace_kv_tier_capacity_bytes", model=LLM, tier="disk") > 0
    assert prompt > 300
