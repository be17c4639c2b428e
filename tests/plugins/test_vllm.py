"""The headrace-vllm plugin on the real SmolLM2, on vLLM's CPU build.

These run in the environment scripts/setup-vllm builds (scripts/test runs them there
with `-m vllm`); anywhere vLLM is not installed they skip.
"""

from __future__ import annotations

import math
from contextlib import aclosing
from pathlib import Path

import anyio
import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm builds .venv-vllm)")
pytest.importorskip("headrace_vllm", reason="the headrace-vllm plugin is not installed here")

from anyio.from_thread import start_blocking_portal  # noqa: E402

from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams  # noqa: E402
from headrace_vllm import EngineError, VLLMEngine  # noqa: E402

from conftest import ROOT, Server  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG_ENOUGH = 300.0  # seconds: loading and first batches on a busy 2-core machine


class Batches:
    """The engine's batch observations, as the daemon's metrics receive them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def __call__(self, op: str, size: int, start: float, end: float) -> None:
        assert end >= start
        self.seen.append((op, size))


@pytest.fixture(scope="module")
def vllm_engine():
    """(portal, engine, batches): one vLLM engine for the module (it loads in tens of seconds)."""
    batches = Batches()
    env = EngineEnv(data_dir=Path("/nonexistent"), cache_dir=Path.home() / ".cache" / "headrace",
                    lookup=lambda name: None, observe_batch=batches)
    # 32-token KV blocks: the prefix cache shares whole blocks, so short test prompts share some.
    engine = VLLMEngine(EngineSpec(name="smollm2", plugin="vllm",
                                   options={"max_model_len": 256, "threads": 2, "block_size": 32}), env)
    with start_blocking_portal() as portal:
        future, _ = portal.start_task(engine.run)
        try:
            yield portal, engine, batches
        finally:
            future.cancel()


async def collect(deltas) -> tuple[str, list[int], str | None]:
    text, ids, finish = "", [], None
    with anyio.fail_after(LONG_ENOUGH):
        async with aclosing(deltas) as stream:
            async for delta in stream:
                text += delta.text
                ids += delta.token_ids
                finish = delta.finish_reason
    return text, ids, finish


def prompt(engine, question: str) -> list[int]:
    return engine.chat_tokens([{"role": "user", "content": question}])


def test_a_fork_decodes_as_the_same_tokens_in_one_context(vllm_engine):
    portal, engine, _ = vllm_engine
    parent = prompt(engine, "Rivers carry water from the hills to the sea, and lakes hold it for a while. "
                            "Rain falls on the hills again, and the rivers run once more to the sea. "
                            "List three colours of the rainbow.")
    child = engine.encode(" Answer briefly, please, and in one line of plain text.")
    assert len(parent) > 64  # two whole KV blocks at least

    async def forked():
        await engine.prefill("parent", parent)
        before = engine.stats()["cached_tokens"]
        await engine.prefill("child", child, parent="parent")
        fork_hit = engine.stats()["cached_tokens"] - before
        before = engine.stats()["cached_tokens"]
        out = await collect(engine.decode("child", GREEDY))
        decode_hit = engine.stats()["cached_tokens"] - before
        await engine.free("child")
        await engine.free("parent")
        # The child's prefill reused the parent's KV, and its decode the child's (Ayo's split).
        assert fork_hit >= 64 and decode_hit >= 64, (fork_hit, decode_hit)
        return out

    async def whole():
        await engine.prefill("whole", parent + child)
        out = await collect(engine.decode("whole", GREEDY))
        await engine.free("whole")
        return out

    # Each run starts from an empty prefix cache, so neither reuses the other's KV.
    assert portal.call(engine.reset_prefix_cache)
    one = portal.call(whole)
    assert portal.call(engine.reset_prefix_cache)
    fork = portal.call(forked)
    assert fork[1] and fork == one
    assert engine.stats()["contexts"] == 0


def test_the_engine_core_runs_in_this_process(vllm_engine):
    import psutil

    portal, engine, _ = vllm_engine
    _, ids, _ = portal.call(collect, engine.generate(prompt(engine, "Hi"), GREEDY))
    assert ids
    assert psutil.Process().children(recursive=True) == []  # no engine-core or worker subprocess


def test_leaving_a_stream_aborts_the_request(vllm_engine):
    portal, engine, _ = vllm_engine

    async def leave_early():
        stream = engine.generate(prompt(engine, "Write a long story about a river."),
                                 SamplingParams(max_tokens=200, temperature=0.0))
        async with aclosing(stream):
            with anyio.fail_after(LONG_ENOUGH):
                first = await stream.__anext__()
        assert first.finish_reason is None
        # The abort reaches the worker on its next loop; vLLM then holds nothing.
        with anyio.fail_after(LONG_ENOUGH):
            while engine.stats()["requests"]:
                await anyio.sleep(0.05)

    portal.call(leave_early)


def test_a_cancelled_request_is_aborted(vllm_engine):
    portal, engine, _ = vllm_engine

    async def cancel_mid_stream():
        got_one = anyio.Event()

        async def consume():
            async for _ in engine.generate(prompt(engine, "Count from one to a hundred."),
                                           SamplingParams(max_tokens=200, temperature=0.0)):
                got_one.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(LONG_ENOUGH):
                await got_one.wait()
            tg.cancel_scope.cancel()
        with anyio.fail_after(LONG_ENOUGH):
            while engine.stats()["requests"]:
                await anyio.sleep(0.05)

    portal.call(cancel_mid_stream)


def test_concurrent_streams_batch_together(vllm_engine):
    portal, engine, batches = vllm_engine
    questions = ["What is a river?", "What is a lake?", "What is the sea?", "What is rain?"]

    async def together():
        results = {}

        async def one(q):
            results[q] = await collect(engine.generate(prompt(engine, q), SamplingParams(max_tokens=16,
                                                                                          temperature=0.0)))

        async with anyio.create_task_group() as tg:
            for q in questions:
                tg.start_soon(one, q)
        return results

    batches.seen.clear()
    results = portal.call(together)
    assert all(ids for _, ids, _ in results.values())
    assert max(size for op, size in batches.seen if op == "decode") > 1


def test_max_tokens_and_stop_strings(vllm_engine):
    portal, engine, _ = vllm_engine
    tokens = prompt(engine, "Describe the water cycle.")
    text, ids, finish = portal.call(collect, engine.generate(tokens, SamplingParams(max_tokens=5, temperature=0.0)))
    assert (len(ids), finish) == (5, "length")

    full, _, _ = portal.call(collect, engine.generate(tokens, SamplingParams(max_tokens=24, temperature=0.0)))
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]  # a word in the middle of the greedy answer
    cut = full[: full.index(stop)]
    text, _, finish = portal.call(collect, engine.generate(tokens, SamplingParams(max_tokens=24, temperature=0.0,
                                                                                  stop=(stop,))))
    assert (text, finish) == (cut, "stop")


def test_priority_is_accepted(vllm_engine):
    portal, engine, _ = vllm_engine
    tokens = prompt(engine, "Say hello.")

    async def with_priorities():
        await engine.prefill("urgent", tokens, priority=-5)
        urgent = await collect(engine.decode("urgent", GREEDY, priority=-5))
        await engine.free("urgent")
        late = await collect(engine.generate(tokens, GREEDY, priority=10))
        scored = await engine.next_token_logits([tokens], [tokens[0]], priority=3)  # the LLM reranker's call
        return urgent, late, scored

    urgent, late, scored = portal.call(with_priorities)
    assert urgent[1] and late[1] and scored.shape == (1, 1)

    async def bad_priority():
        await collect(engine.generate(tokens, GREEDY, priority="high"))

    with pytest.raises(EngineError, match="priority"):
        portal.call(bad_priority)


def test_bad_requests_fail_alone_with_a_clear_error(vllm_engine):
    portal, engine, _ = vllm_engine
    too_long = [engine.encode("river")[0]] * engine.max_context_tokens

    async def over_the_context():
        await collect(engine.generate(too_long, GREEDY))

    with pytest.raises(EngineError, match="holds at most"):
        portal.call(over_the_context)

    async def unknown_token():
        await engine.prefill("bad", [engine.vocab_size + 7])

    with pytest.raises(EngineError, match="not in the vocabulary"):
        portal.call(unknown_token)

    async def unknown_context():
        await collect(engine.decode("missing", GREEDY))

    with pytest.raises(EngineError, match="does not exist"):
        portal.call(unknown_context)

    # The engine still serves.
    _, ids, _ = portal.call(collect, engine.generate(prompt(engine, "Hi"), GREEDY))
    assert ids


def test_next_token_logits_rank_the_greedy_token_first(vllm_engine):
    portal, engine, _ = vllm_engine
    prompts = [prompt(engine, "Is water wet? Answer yes or no."), prompt(engine, "Name a colour.")]
    firsts = [portal.call(collect, engine.generate(p, SamplingParams(max_tokens=1, temperature=0.0)))[1][0]
              for p in prompts]
    candidates = sorted(set(firsts) | set(engine.encode(" yes no maybe")))
    logits = portal.call(engine.next_token_logits, prompts, candidates)
    assert logits.shape == (2, len(candidates))
    for row, first in enumerate(firsts):
        assert candidates[int(logits[row].argmax())] == first
    assert portal.call(engine.next_token_logits, [], candidates).shape == (0, len(candidates))


def test_unknown_options_are_refused():
    env = EngineEnv(data_dir=Path("."), cache_dir=Path("."), lookup=lambda name: None)
    with pytest.raises(ValueError, match="unknown option.*speed"):
        VLLMEngine(EngineSpec(name="x", plugin="vllm", options={"speed": 11}), env)
    with pytest.raises(ValueError, match="dtype"):
        VLLMEngine(EngineSpec(name="x", plugin="vllm", options={"dtype": "int3"}), env)


def test_the_daemon_serves_chat_with_the_vllm_config(tmp_path):
    server = Server(ROOT / "configs" / "vllm-cpu.toml", tmp_path).wait_ready(timeout=600)
    try:
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=LONG_ENOUGH, json={
            "model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What colour is the sky?"}],
        })
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] <= 8

        too_long = httpx.post(f"{server.base_url}/v1/completions", timeout=LONG_ENOUGH, json={
            "model": "smollm2", "max_tokens": 4, "prompt": [42] * 5000,
        })
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
    finally:
        server.stop()


def test_logprobs_are_vllms_mapped_to_headraces(vllm_engine):
    """vLLM's own logprobs (its raw log-softmax) reach TokenDelta.logprobs: one per token, the k best by rank."""
    portal, engine, _ = vllm_engine
    question = prompt(engine, "Name a colour.")

    async def deltas(params):
        with anyio.fail_after(LONG_ENOUGH):
            return [d async for d in engine.generate(question, params)]

    got = portal.call(deltas, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    ids = [t for d in got for t in d.token_ids]
    lps = [lp for d in got for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == ids
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the sampled token ranks first
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
    # A distribution: the three best hold at most all of the probability.
    assert sum(math.exp(v) for _, v in lps[0].top) <= 1 + 1e-4
    # next_token_logits reads the same raw log-softmax: the first token's agrees.
    scored = portal.call(engine.next_token_logits, [question], [ids[0]])
    assert float(scored[0, 0]) == pytest.approx(lps[0].logprob, abs=0.05)
    assert all(d.logprobs == () for d in portal.call(deltas, SamplingParams(max_tokens=2, temperature=0.0)))


def test_constraints_reach_vllm_structured_outputs(vllm_engine):
    import json

    from headrace.plugins.engines.chat import format_tool_call
    from headrace.plugins.protocols import JsonSchemaConstraint, LarkConstraint

    portal, engine, _ = vllm_engine
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=JsonSchemaConstraint(json.dumps(schema)))
    text, _, finish = portal.call(collect, engine.generate(prompt(engine, "Write a haiku about rivers."), params))
    data = json.loads(text)
    assert finish == "stop" and set(data) == {"name", "age"} and 0 <= data["age"] <= 120
    assert text.startswith('{"name": ')  # the same compact layout as the built-in engines
    call = {"type": "object", "properties": {"name": {"const": "get_time"}, "arguments": {"type": "object",
            "properties": {}, "additionalProperties": False}}, "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    grammar = 'start: call\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json ' + json.dumps(call)
    params = SamplingParams(max_tokens=40, temperature=0.0, constraint=LarkConstraint(grammar))
    text, _, finish = portal.call(collect, engine.generate(prompt(engine, "What time is it?"), params))
    assert finish == "stop" and text == format_tool_call("get_time", {})
