"""OpenAI requests join programs (issue 28 item 1): the body fields and the header that name one, the
tokens counted to it, and a bad ``prompt_cache_key`` answered with OpenAI's error envelope. In-process,
no model loaded."""

from __future__ import annotations

from contextlib import aclosing
from types import SimpleNamespace

import anyio
import pytest
from starlette.testclient import TestClient

from headrace.batching.programs import ProgramRegistry
from headrace.daemon import bodies as rq
from headrace.daemon.app import create_app
from headrace.daemon.config import load_config
from headrace.daemon.errors import APIError
from headrace.daemon.routes.openai_api import _program, _served
from headrace.daemon.openai_schemas import ChatCompletionRequest, CompletionRequest
from headrace.graph.collector import ChoiceDelta
from headrace.graph.ops import OpContext
from headrace.plugins.protocols import TokenDelta

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def fake_request(headers: dict[str, str] | None = None, principal: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(headers=headers or {}, state=SimpleNamespace(principal=principal))


def test_the_request_names_its_program_by_key_then_user_then_header():
    hdr = {"x-headrace-program": "h1"}
    both = rq.validate(ChatCompletionRequest, {**CHAT, "prompt_cache_key": "conv-1", "user": "alice"})
    assert _program(fake_request(hdr), both) == "key:conv-1"
    user = rq.validate(CompletionRequest, {"model": "m", "prompt": "hi", "user": "alice"})
    assert _program(fake_request(hdr), user) == "user:alice"
    assert _program(fake_request(hdr), rq.validate(ChatCompletionRequest, CHAT)) == "header:h1"
    assert _program(fake_request(), rq.validate(ChatCompletionRequest, CHAT)) is None  # a program of one call
    # Per API key: two clients' equal keys are two programs.
    assert _program(fake_request(principal="k1"), both) != _program(fake_request(principal="k2"), both)


@pytest.mark.parametrize("value", [5, ["a"], {"a": 1}, True])
def test_a_prompt_cache_key_not_a_string_is_400(value):
    with pytest.raises(APIError) as err:
        rq.validate(ChatCompletionRequest, {**CHAT, "prompt_cache_key": value})
    assert err.value.status == 400 and err.value.body()["error"]["param"] == "prompt_cache_key"


def test_a_bad_prompt_cache_key_is_400_with_the_envelope_over_http(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\ndir = "{tmp_path}"\n')
    with TestClient(create_app(load_config(config, env={}))) as client:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "m", "prompt": "hi"})):
            r = client.post(path, json={**body, "prompt_cache_key": 7})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == "prompt_cache_key"
            # A string one passes validation (then: no such model).
            assert client.post(path, json={**body, "prompt_cache_key": "p"}).status_code == 404


def test_a_finished_request_counts_its_prompt_and_generated_tokens_to_its_program():
    reg = ProgramRegistry()

    async def deltas():
        yield ChoiceDelta(0, TokenDelta(text="a", token_ids=[1, 2]))
        yield ChoiceDelta(1, TokenDelta(text="b", token_ids=[3], finish_reason="stop"))

    async def drain(stop_after: int | None = None) -> None:
        async with aclosing(_served(deltas(), reg, "key:p", n_prompt=10)) as served:
            seen = 0
            async for _ in served:
                seen += 1
                if seen == stop_after:
                    break  # the client left: what was served so far counts

    anyio.run(drain)
    assert reg.attained("key:p") == 13
    anyio.run(drain)
    assert reg.attained("key:p") == 26  # accumulates over requests
    anyio.run(drain, 1)
    assert reg.attained("key:p") == 26 + 12


def test_the_program_reaches_every_meta_of_the_run():
    ctx = OpContext("run-1", resolve=lambda name: None, program="key:p", attained_tokens=42)
    node = SimpleNamespace(id="c0", depth=0, prefix_hash=None)
    for meta in (ctx.meta(node), ctx.run_meta()):
        assert (meta.run, meta.program, meta.attained_tokens, meta.program_id) == ("run-1", "key:p", 42, "key:p")
    plain = OpContext("run-2", resolve=lambda name: None).meta(node)
    assert (plain.program, plain.attained_tokens, plain.program_id) == (None, 0, "run-2")


def test_a_requests_cached_prompt_tokens_are_not_counted_to_its_program():
    """What the engine found in its prefix cache (its first delta says) was not computed: a client agent's
    resent history is no new service."""
    reg = ProgramRegistry()

    async def deltas():
        yield ChoiceDelta(0, TokenDelta(text="a", token_ids=[1], cached_tokens=96))
        yield ChoiceDelta(0, TokenDelta(text="b", token_ids=[2], finish_reason="stop"))

    async def drain() -> None:
        async with aclosing(_served(deltas(), reg, "key:p", n_prompt=100)) as served:
            async for _ in served:
                pass

    anyio.run(drain)
    assert reg.attained("key:p") == 100 - 96 + 2
