"""Teacher-forced prompt scores over the API (issue 47 part 1): /v1/completions' echo (with logprobs, and with
max_tokens 0), vLLM's prompt_logprobs on completions and chat, and their 400s, against the session's daemon (the
real 135M model). The scores are checked against what the model itself does: teacher-forcing the greedy answer
must give the logprobs its decode reported, which fails if a position is off by one."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest

from conftest import API_KEY, metric_value

LLM = "smollm2"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The river turns the mill wheel, and the miller grinds the"
# A prefill (many positions in one pass) and a decode (one position) need not round alike; on llama.cpp they
# have agreed exactly so far. Off by one position, the scores are other tokens' and differ by far more.
TEACHER_FORCED_ABS = 1e-3


def post(server, path, body, timeout=300):
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=timeout)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def complete(server, **body) -> dict:
    return ok(post(server, "/v1/completions", {"model": LLM, "temperature": 0, **body}))


def tokenize(server, **body) -> list[int]:
    return ok(post(server, "/tokenize", {"model": LLM, **body}))["tokens"]


def error_of(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    return error


def check_offsets(lp: dict) -> None:
    assert lp["text_offset"][0] == 0
    for i in range(1, len(lp["tokens"])):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])


# echo --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_echo_puts_the_prompt_first_in_text_and_logprobs(server):
    prompt_ids = tokenize(server, prompt=PROMPT, add_special_tokens=False)
    r = complete(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    out = r["usage"]["completion_tokens"]
    assert r["usage"]["prompt_tokens"] == len(prompt_ids) and out == 4
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt_ids) + out
    assert "".join(lp["tokens"]) == choice["text"]  # plain ASCII: the token strings spell the text
    # Nothing precedes the first prompt token: null, as OpenAI and vLLM give it; every other entry is scored.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
    check_offsets(lp)
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the k most likely, and the actual token
    # Without echo the same request gives the same output part.
    plain = complete(server, prompt=PROMPT, logprobs=2, max_tokens=4)["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    assert lp["tokens"][len(prompt_ids):] == plain["logprobs"]["tokens"]
    # echo alone: the text, no logprobs
    bare = complete(server, prompt=PROMPT, echo=True, max_tokens=4)["choices"][0]
    assert bare["text"] == choice["text"] and bare["logprobs"] is None


@pytest.mark.slow
def test_teacher_forcing_the_greedy_answer_gives_the_decodes_own_logprobs(server):
    prompt_ids = tokenize(server, prompt=PROMPT, add_special_tokens=False)
    greedy = complete(server, prompt=prompt_ids, logprobs=1, max_tokens=12)["choices"][0]
    assert greedy["finish_reason"] == "length", greedy  # no end token: the text holds every generated token
    answer_ids = tokenize(server, prompt=greedy["text"], add_special_tokens=False)
    scored = complete(server, prompt=prompt_ids + answer_ids, echo=True, logprobs=1, max_tokens=0)
    choice = scored["choices"][0]
    lp = choice["logprobs"]
    # The answer re-tokenizes to the tokens the decode made (else the comparison below would not be one).
    assert lp["tokens"][len(prompt_ids):] == greedy["logprobs"]["tokens"]
    forced = lp["token_logprobs"][len(prompt_ids):]
    decoded = greedy["logprobs"]["token_logprobs"]
    assert forced == pytest.approx(decoded, abs=TEACHER_FORCED_ABS)
    # Shifted one position either way, the scores would be another token's: they must not match.
    assert forced[1:] != pytest.approx(decoded[:-1], abs=TEACHER_FORCED_ABS)
    # Greedy: each answer token is the most likely at its position, teacher-forced too.
    for token, logprob, top in zip(lp["tokens"][len(prompt_ids):], forced, lp["top_logprobs"][len(prompt_ids):]):
        assert max(top.values()) == logprob
    assert choice["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    assert choice["text"] == PROMPT + greedy["text"]  # a token-id prompt is echoed decoded


@pytest.mark.slow
def test_top_logprobs_are_sorted_and_place_the_actual_token_by_its_rank(server):
    k = 5
    r = complete(server, prompt=PROMPT, echo=True, logprobs=k, prompt_logprobs=k, max_tokens=0)
    choice = r["choices"][0]
    lp, plp = choice["logprobs"], choice["prompt_logprobs"]
    prompt_ids = tokenize(server, prompt=PROMPT, add_special_tokens=False)
    assert len(plp) == len(prompt_ids) and plp[0] is None
    outside = 0
    for i in range(1, len(prompt_ids)):
        actual = str(prompt_ids[i])
        entry = plp[i]
        assert actual in entry and entry[actual]["logprob"] == lp["token_logprobs"][i]
        assert entry[actual]["decoded_token"] == lp["tokens"][i]
        alternatives = [v for key, v in entry.items() if key != actual or v["rank"] <= k]
        top = sorted(alternatives, key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == list(range(1, k + 1))
        assert [v["logprob"] for v in top] == sorted((v["logprob"] for v in top), reverse=True)
        rank = entry[actual]["rank"]
        more_likely = sum(v["logprob"] > entry[actual]["logprob"] for v in top)
        if rank <= k:  # among the top k: at its place
            assert more_likely == rank - 1
        else:  # below them all
            outside += 1
            assert len(entry) == k + 1 and more_likely == k and entry[actual]["logprob"] <= top[-1]["logprob"]
        # completions' top_logprobs hold the same k by token string, and the actual token
        assert set(lp["top_logprobs"][i]) == {v["decoded_token"] for v in entry.values()}
        assert list(lp["top_logprobs"][i].values())[:k] == [v["logprob"] for v in top]
    assert outside, "every prompt token was among the top 5: the rank past k went untested"


@pytest.mark.slow
def test_a_rank_past_k_is_counted_over_the_whole_vocabulary(server):
    """prompt_logprobs 0: only the actual token, whose rank says where it stands among every token."""
    one = complete(server, prompt=PROMPT, prompt_logprobs=0, max_tokens=1)["choices"][0]["prompt_logprobs"]
    wide = complete(server, prompt=PROMPT, prompt_logprobs=20, max_tokens=1)["choices"][0]["prompt_logprobs"]
    for small, big in zip(one[1:], wide[1:]):
        (token, entry), = small.items()
        assert big[token]["rank"] == entry["rank"] and big[token]["decoded_token"] == entry["decoded_token"]
        assert big[token]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
        ranks = sorted(v["rank"] for key, v in big.items() if key != token or v["rank"] <= 20)
        assert ranks == list(range(1, 21))
        assert (entry["rank"] > 20) == (len(big) == 21)


@pytest.mark.slow
def test_max_tokens_zero_scores_only_the_prompt(server):
    r = complete(server, prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
    choice = r["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"]
    assert len(choice["logprobs"]["tokens"]) == r["usage"]["prompt_tokens"]
    assert all(top is None or len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # k = 0: the actual
    both = complete(server, prompt=PROMPT, echo=True, max_completion_tokens=0, max_tokens=5)["choices"][0]
    assert both["text"] == PROMPT and both["logprobs"] is None  # max_completion_tokens wins, as for generating


@pytest.mark.slow
def test_batches_of_token_id_prompts_each_echo_their_own(server):
    """What lm-eval sends: several token-id prompts in one request, echo, logprobs 1, max_tokens 1."""
    texts = [PROMPT, "Water flows downhill to the", "A headrace carries"]
    ids = [tokenize(server, prompt=t, add_special_tokens=False) for t in texts]
    r = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=1, n=2)
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert r["usage"]["prompt_tokens"] == sum(map(len, ids)) and r["usage"]["completion_tokens"] == 6
    for i, prompt in enumerate(ids):
        alone = complete(server, prompt=prompt, echo=True, logprobs=1, max_tokens=1)["choices"][0]
        for choice in r["choices"][2 * i:2 * i + 2]:
            assert choice["text"] == alone["text"] and choice["text"].startswith(texts[i])
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(prompt) + 1
            # scored beside other prompts, or alone: other batch shapes, the same scores but for rounding
            assert lp["token_logprobs"][1:] == pytest.approx(alone["logprobs"]["token_logprobs"][1:],
                                                             abs=TEACHER_FORCED_ABS)
    strings = complete(server, prompt=texts, echo=True, logprobs=1, max_tokens=0)
    for choice, prompt in zip(strings["choices"], ids):
        assert len(choice["logprobs"]["tokens"]) == len(prompt)


@pytest.mark.slow
def test_a_streamed_echo_sends_the_prompt_first(server):
    body = {"model": LLM, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    whole = complete(server, **{k: v for k, v in body.items() if k not in ("stream", "stream_options", "model")})
    assert "".join(p["text"] for p in parts) == whole["choices"][0]["text"]
    joined = {key: [x for p in parts if p["logprobs"] for x in p["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "text_offset")}
    expected = whole["choices"][0]["logprobs"]
    assert joined["tokens"] == expected["tokens"] and joined["text_offset"] == expected["text_offset"]
    assert joined["token_logprobs"][1:] == pytest.approx(expected["token_logprobs"][1:], abs=TEACHER_FORCED_ABS)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    # max_tokens 0, streamed: one chunk per choice, the prompt, and its end
    body.update(max_tokens=0, n=2)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [(e["choices"][0]["index"], e["choices"][0]["text"], e["choices"][0]["finish_reason"])
            for e in events if e["choices"]] == [(0, PROMPT, "length"), (1, PROMPT, "length")]


# prompt_logprobs ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_prompt_logprobs_in_vllms_shape_on_completions_and_chat(server):
    messages = [{"role": "user", "content": "Name a river."}]
    ids = tokenize(server, messages=messages)
    chat = ok(post(server, "/v1/chat/completions", {"model": LLM, "messages": messages, "max_tokens": 2,
                                                    "temperature": 0, "prompt_logprobs": 2}))
    plp = chat["prompt_logprobs"]
    assert len(plp) == len(ids) == chat["usage"]["prompt_tokens"] and plp[0] is None
    for token, entry in zip(ids[1:], plp[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"} and key.isdigit()
            assert value["logprob"] <= 0 and value["rank"] >= 1
    assert "prompt_logprobs" not in chat["choices"][0]
    # The chat template's tokens, sent as a token-id prompt, score the same on /v1/completions.
    text = complete(server, prompt=ids, prompt_logprobs=2, max_tokens=1)
    same = text["choices"][0]["prompt_logprobs"]
    assert [None if e is None else sorted(e) for e in same] == [None if e is None else sorted(e) for e in plp]
    for a, b in zip(same[1:], plp[1:]):
        for key in a:
            assert a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-4)
    assert text["choices"][0]["logprobs"] is None  # prompt_logprobs alone asks no output logprobs
    plain = complete(server, prompt=PROMPT, max_tokens=1)
    assert "prompt_logprobs" not in plain["choices"][0]


# 400s ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"prompt": PROMPT, "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": PROMPT, "echo": "yes"}, "echo"),
    ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
])
def test_bad_echo_and_prompt_logprobs_are_400_naming_the_field(server, body, param):
    error_of(post(server, "/v1/completions", {"model": LLM, **body}), param)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True},
                                   {"echo": True}])
def test_bad_chat_prompt_logprobs_are_400(server, extra):
    body = {"model": LLM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    error_of(post(server, "/v1/chat/completions", body), next(iter(extra)))


def test_an_engine_that_cannot_score_prompts_refuses_by_name():
    from headrace.daemon import bodies as rq
    from headrace.daemon import prompt_logprobs as scoring
    from headrace.daemon.errors import APIError
    from headrace.daemon.openai_schemas import ChatCompletionRequest, CompletionRequest

    slot = SimpleNamespace(name="vllm-model", engine=object())  # no prompt_logprobs: as the vLLM plugin
    spec = rq.StreamSpec(stream=False, include_usage=False)

    def refused(plan, body) -> str:
        with pytest.raises(APIError) as err:
            plan(slot, body, spec)
        assert err.value.status == 400 and err.value.code == "unsupported_parameter"
        return err.value.param

    echo = CompletionRequest.model_validate({"model": "m", "prompt": "a", "echo": True, "logprobs": 1})
    assert refused(scoring.completion_plan, echo) == "echo"
    both = CompletionRequest.model_validate({"model": "m", "prompt": "a", "echo": True, "prompt_logprobs": 1})
    assert refused(scoring.completion_plan, both) == "prompt_logprobs"
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                                 "prompt_logprobs": 0})
    assert refused(scoring.chat_plan, chat) == "prompt_logprobs"
    # echo without logprobs is only text: any engine serves it
    text = CompletionRequest.model_validate({"model": "m", "prompt": "a", "echo": True, "max_tokens": 0})
    assert scoring.completion_plan(slot, text, spec) == scoring.ScoringPlan(True, None, None, generate=False)


# disconnect ------------------------------------------------------------------------------------


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.slow
def test_a_client_that_leaves_frees_the_scoring(server):
    """A client that leaves while its prompts are scored frees the engine at its next step, long before the
    scoring would have ended (measured against one of the prompts scored alone: the machine's pace now)."""
    ids = tokenize(server, prompt=" ".join(["the river turns the mill wheel"] * 100), add_special_tokens=False)
    prompts = [ids[i:i + 600] for i in range(16)]
    t0 = time.monotonic()
    complete(server, prompt=prompts[0], echo=True, logprobs=1, max_tokens=0)
    one = time.monotonic() - t0  # the whole request would take about 16 times this
    body = json.dumps({"model": LLM, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    running = lambda: metric_value(server.metrics(), "headrace_num_requests_running", model=LLM)  # noqa: E731
    contexts = lambda: metric_value(server.metrics(), "headrace_llm_contexts", model=LLM)  # noqa: E731
    assert wait_for(lambda: running() == 0 and contexts() == 0, 60)
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(head + body)
        assert wait_for(lambda: running() >= 1 and contexts() >= 1, 30), "the scoring never started"
    finally:
        sock.close()
    left = time.monotonic()
    # The scheduler lets go at once; the engine drops the contexts at its next step (a chunk of at most
    # max_batch_tokens, under one prompt's worth here).
    assert wait_for(lambda: running() == 0, 5), "the request still holds the scheduler after the client left"
    assert wait_for(lambda: contexts() == 0, 6 * one + 5), "the engine went on scoring after the client left"
    assert time.monotonic() - left < 6 * one + 5
    complete(server, prompt=prompts[0], echo=True, logprobs=1, max_tokens=0)  # and serves the next request
