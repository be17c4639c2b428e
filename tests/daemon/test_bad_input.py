"""Bad input against a real server: each is a 4xx with OpenAI's error envelope, and never hurts a
concurrent normal request (issue 9, parts 1-6)."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import API_KEY, metric_value

pytestmark = pytest.mark.slow

LLM, EMBED, RERANK = "smollm2", "all-minilm-l6-v2", "smollm2-rerank"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
DOCS = ["A headrace is the channel that carries water to a mill wheel.",
        "The tailrace carries the water away from the wheel, back to the river."]
CHAT = {"model": LLM, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank",
               "/v1/workflows/naive_rag/runs"]
INTERNALS = ("Traceback", "RecursionError", "UnicodeEncodeError", "IndexError", "KeyError", "TypeError",
             "RuntimeError", "task group")


def post(server, path, body, timeout=300):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, headers=HEADERS, timeout=timeout)


def assert_envelope(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert not any(word in error["message"] for word in INTERNALS), error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def alongside_normal(server, bad):
    """Send ``bad()`` while a normal chat completion runs; the normal one must succeed."""
    with ThreadPoolExecutor(2) as pool:
        normal = pool.submit(post, server, "/v1/chat/completions", CHAT)
        result = pool.submit(bad).result()
        r = normal.result()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return result


# part 5: 500s where the client erred ------------------------------------------------------


@pytest.mark.parametrize("path", POST_ROUTES)
def test_deep_json_is_400_on_every_post_route(server, path):
    deep = b"[" * 10_000 + b"]" * 10_000
    assert_envelope(post(server, path, deep)).get("code") == "invalid_json"
    nested = b'{"model": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}"
    assert_envelope(post(server, path, nested))


SURROGATE = "\\ud800"  # a JSON escape of a lone surrogate: valid JSON, not encodable text


def raw(template: str) -> bytes:
    return template.replace("@", SURROGATE).encode()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "@": 1}', None),
    ("/v1/chat/completions", '{"model": "@", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/v1/chat/completions", '{"model": "smollm2", "messages": [{"role": "user", "content": "a@"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "smollm2", "prompt": "@"}', "prompt"),
    ("/v1/completions", '{"model": "smollm2", "prompt": ["@"]}', "prompt[0]"),
    ("/v1/embeddings", '{"model": "all-minilm-l6-v2", "input": "@"}', "input"),
    ("/v1/embeddings", '{"model": "all-minilm-l6-v2", "input": ["ok", "@"]}', "input[1]"),
    ("/v1/rerank", '{"model": "smollm2-rerank", "query": "@", "documents": ["a"]}', "query"),
    ("/v1/rerank", '{"model": "smollm2-rerank", "query": "q", "documents": ["a", "@"]}', "documents[1]"),
    ("/v1/workflows/naive_rag/runs", '{"inputs": {"question": "@", "documents": ["a b c"]}}', "inputs.question"),
    ("/v1/workflows/naive_rag/runs", '{"inputs": {"question": "q", "documents": ["a b c"]}, '
                                     '"config": {"batch_policy": "@"}}', "config.batch_policy"),
])
def test_lone_surrogates_are_400(server, path, body, param):
    r = alongside_normal(server, lambda: post(server, path, raw(body)))
    assert_envelope(r, param=param)


@pytest.mark.parametrize("prompt", ["", [""], [], [1, -1], [1, 10**7], [2**63], [2**64 + 5]])
def test_bad_completion_prompts_are_400(server, prompt):
    r = alongside_normal(server, lambda: post(server, "/v1/completions", {"model": LLM, "prompt": prompt,
                                                                         "max_tokens": 2}))
    error = assert_envelope(r)
    assert error["param"].startswith("prompt")


def test_token_ids_inside_the_vocabulary_work(server):
    r = post(server, "/v1/completions", {"model": LLM, "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_unsupported_and_neutral_parameters(server):
    r = post(server, "/v1/chat/completions", {**CHAT, "n": 129})
    assert assert_envelope(r, param="n")["code"] == "invalid_value"
    r = post(server, "/v1/chat/completions", {**CHAT, "tools": []})
    assert assert_envelope(r, param="tools")["code"] == "invalid_value"  # as OpenAI: at least one tool
    neutral = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "parallel_tool_calls": None,
               "logit_bias": {}, "response_format": {"type": "text"}}
    assert post(server, "/v1/chat/completions", {**CHAT, **neutral}).status_code == 200


# part 2: sampling values ------------------------------------------------------------------


def test_seed_outside_the_generator_range_is_400(server):
    r = alongside_normal(server, lambda: post(server, "/v1/chat/completions", {**CHAT, "seed": 2**64}))
    assert_envelope(r, param="seed")
    assert post(server, "/v1/chat/completions", {**CHAT, "seed": 2**64 - 1}).status_code == 200
    assert post(server, "/v1/chat/completions", {**CHAT, "seed": -(2**63)}).status_code == 200


@pytest.mark.parametrize("extra", [{"temperature": 1e-40}, {"top_p": 1e-300}, {"temperature": 1e-40, "top_p": 1e-300}])
def test_tiny_sampling_values_decode_greedily(server, extra):
    # Valid values, so served: a tiny temperature is greedy (as vLLM), a top_p that rounds to 0 keeps the top token.
    r = alongside_normal(server, lambda: post(server, "/v1/chat/completions", {**CHAT, **extra, "seed": 7}))
    assert r.status_code == 200, r.text
    greedy = post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]
    assert r.json()["choices"][0]["message"]["content"] == greedy


# part 4: bounds ---------------------------------------------------------------------------


def test_rerank_over_the_document_bound_is_400(server):
    body = {"model": RERANK, "query": "q", "documents": [f"doc {i}" for i in range(1001)]}
    r = alongside_normal(server, lambda: post(server, "/v1/rerank", body))
    assert assert_envelope(r, param="documents")["code"] == "too_many_documents"


@pytest.mark.parametrize("config, param", [
    ({"chunk_size": 2**70}, "config.chunk_size"),
    ({"chunk_size": 4096}, "config.chunk_size"),
    ({"top_k": 10**6}, "config.top_k"),
    ({"chunk_overlap": 10**9}, "config.chunk_overlap"),
    ({"max_tokens": 10**9}, "config.max_tokens"),
])
def test_workflow_integers_are_bounded(server, config, param):
    body = {"inputs": {"question": "What does a headrace carry?", "documents": DOCS}, "config": config}
    assert_envelope(post(server, "/v1/workflows/naive_rag/runs", body), param=param)


# part 1 and 5: run inputs are refused before the run starts -----------------------------


@pytest.mark.parametrize("inputs, config, param", [
    ({}, {"engines": {"llm": "nope"}}, "config.engines.llm"),
    ({}, {"engines": {"llm": 5}}, "config.engines.llm"),
    ({}, {"engines": {"llm": EMBED}}, "config.engines.llm"),
    ({}, {"engines": {"embed": LLM}}, "config.engines.embed"),
    ({}, {"engines": {"gpu": LLM}}, "config.engines.gpu"),
    ({}, {"engines": "smollm2"}, "config.engines"),
    ({"question": " ".join(["word"] * 5000)}, {}, "inputs.question"),
    ({"question": "water " * 680_000}, {}, "inputs.question"),  # 3.9 MiB
])
def test_bad_run_inputs_are_400_before_the_run(server, inputs, config, param):
    body = {"inputs": {"question": "What does a headrace carry?", "documents": DOCS, **inputs}, "config": config}
    runs_before = metric_value(server.metrics(), "headrace_egraph_cache_misses_total")
    r = alongside_normal(server, lambda: post(server, "/v1/workflows/naive_rag/runs", body))
    assert_envelope(r, param=param)
    assert metric_value(server.metrics(), "headrace_egraph_cache_misses_total") == runs_before
    ready = httpx.get(f"{server.base_url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["ready"]


def test_a_valid_engine_choice_still_runs(server):
    body = {"inputs": {"question": "What does a headrace carry?", "documents": DOCS},
            "config": {"engines": {"llm": LLM, "embed": EMBED}, "max_tokens": 8, "top_k": 1}}
    r = post(server, "/v1/workflows/naive_rag/runs", body)
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text


def test_a_huge_chat_prompt_is_refused_and_others_go_on(server):
    body = {"model": LLM, "messages": [{"role": "user", "content": "word " * (780 * 1024)}], "max_tokens": 4}
    r = alongside_normal(server, lambda: post(server, "/v1/chat/completions", body))
    assert assert_envelope(r, param="messages")["code"] == "context_length_exceeded"


# part 6: a non-streamed request whose client leaves stops decoding ----------------------


def wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_disconnected_non_stream_chat_stops_decoding(server):
    max_tokens = 1000
    body = json.dumps({"model": LLM, "messages": [{"role": "user", "content": "Count from 1 to 2000, separated by "
                                                                                "commas."}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    running = lambda: metric_value(server.metrics(), "headrace_num_requests_running", model=LLM)  # noqa: E731
    contexts = lambda: metric_value(server.metrics(), "headrace_llm_contexts", model=LLM)  # noqa: E731
    generated = lambda: metric_value(server.metrics(), "headrace_generation_tokens_total", model=LLM)  # noqa: E731
    assert wait_for(lambda: running() == 0 and contexts() == 0)
    before = generated()
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(head + body)
        assert wait_for(lambda: contexts() >= 1), "the request never started"
    finally:
        sock.close()
    assert wait_for(lambda: running() == 0 and contexts() == 0), "the decode went on after the client left"
    # Tokens are counted when a request ends; an aborted one ends well short of max_tokens.
    assert generated() - before < max_tokens
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200
