"""The peers' sampling fields over HTTP (issue 43, part 3): they reach the engine, bad values are a 400 naming the
field, and the fields that change nothing here are accepted. What each field does is the engine contract's
(tests/plugins/test_llm_contract.py), on every engine."""

from __future__ import annotations

import pytest

from test_bad_input import CHAT, LLM, assert_envelope, post

pytestmark = pytest.mark.slow

IGNORED = {"service_tier": "auto", "reasoning_effort": "low", "verbosity": "low", "safety_identifier": "user-1",
           "store": False, "metadata": {"run": "1"}, "parallel_tool_calls": True,
           "prediction": {"type": "content", "content": "Hello"}}


def test_logit_bias_reaches_the_engine_with_every_field_set_and_the_ignored_ones_sent(server):
    prompt = post(server, "/tokenize", {"model": LLM, "prompt": "The capital of France is"}).json()["tokens"]
    greedy = post(server, "/v1/completions", {"model": LLM, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    text = greedy.json()["choices"][0]["text"]
    first = post(server, "/tokenize", {"model": LLM, "prompt": text, "add_special_tokens": False}).json()["tokens"][0]
    r = post(server, "/v1/completions", {"model": LLM, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                         "logit_bias": {str(first): -100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] != text
    # Every sampling field at once, and what OpenAI's clients send that changes nothing here.
    every = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "top_k": 20, "min_p": 0.05,
             "logit_bias": {str(first): -100}, "min_tokens": 3, "ignore_eos": True, "stop_token_ids": [first]}
    r = post(server, "/v1/chat/completions", {**CHAT, **every, **IGNORED, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3  # min_tokens = max_tokens: no end before


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"42": 101}}, "logit_bias.42"), ({"logit_bias": {"cat": 1}}, "logit_bias.cat"),
    ({"logit_bias": {"1000000000": -100}}, "logit_bias.1000000000"),  # not a token id of the model
    ({"stop_token_ids": [7, 10**9]}, "stop_token_ids[1]"), ({"min_tokens": 5}, "min_tokens"),  # max_tokens is 4
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"audio": {"voice": "alloy"}}, "audio"),  # it would change the output
])
def test_bad_sampling_values_are_400_naming_the_field(server, extra, param):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": LLM, "prompt": "Hi",
                                                                            "max_tokens": 4})):
        if param == "audio" and path == "/v1/completions":
            continue
        assert_envelope(post(server, path, {**body, **extra}), param=param)
