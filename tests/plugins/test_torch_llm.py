"""The torch LLM engine on the real SmolLM2: contexts, forks, continuous batching, cancellation."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import torch
from anyio.from_thread import start_blocking_portal

from conftest import check_logprobs_are_log_softmax, idle, prompts_on_a_shared_prefix
from llm_engines import chat, outcome, text_of, wait_for_no_contexts
from headrace.plugins.api import EngineFailed
from headrace.plugins.engines.torch_engine.engine import EngineError, TorchLLM
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture
def llm(torch_smollm2):
    """The session's float32 engine on its own event loop in a thread; tests call into it through the portal."""
    portal, engine, _ = torch_smollm2
    return portal, engine


def test_concurrent_decodes_equal_solo_decodes(llm):
    """Rows of different lengths joining and leaving the batch do not change greedy output."""
    portal, engine = llm
    prompts = [chat(engine, q) for q in (
        "What is 2 + 2?", "Write one sentence about the sea and the wind and the long voyage home.",
        "List three fruits.", "Who wrote Hamlet?")]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (8, 20, 14, 24)]
    solo = [portal.call(text_of, engine.generate(p, sp)) for p, sp in zip(prompts, params)]

    async def together():
        out = [None] * len(prompts)

        async def one(i):
            await anyio.sleep(0.05 * i)  # staggered joins
            out[i] = await text_of(engine.generate(prompts[i], params[i]))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return out

    engine.batches.clear()
    assert portal.call(together) == solo
    assert max(n for op, n in engine.batches if op == "decode") > 1


# ----- faults stay with their request (issue 9) -------------------------------------------

NORMAL_QUESTIONS = ("What is 2 + 2?", "Name a planet.", "Who wrote Hamlet?")


def test_odd_sampling_values_fail_alone_beside_normal_decodes(llm):
    portal, engine = llm
    normal = [chat(engine, q) for q in NORMAL_QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0)
    solo = [portal.call(text_of, engine.generate(p, params)) for p in normal]
    # A params object that skipped validation (a plugin's, say): its generator cannot take the seed.
    unchecked = SamplingParams(max_tokens=16, temperature=1.0)
    object.__setattr__(unchecked, "seed", 2**64)
    odd = [SamplingParams(max_tokens=16, temperature=1e-40), SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-300),
           SamplingParams(max_tokens=16, temperature=1.0, seed=2**64 - 1), unchecked]
    odd_prompt = chat(engine, "Tell me about foxes.")

    async def together():
        out: dict = {}

        async def one(key, prompt, p):
            out[key] = await outcome(engine.generate(prompt, p))

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(normal):
                tg.start_soon(one, ("normal", i), p, params)
            for i, p in enumerate(odd):
                tg.start_soon(one, ("odd", i), odd_prompt, p)
        return out

    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    out = portal.call(together)
    assert [out["normal", i] for i in range(len(normal))] == solo
    # Tiny temperature and top_p are greedy; a huge valid seed samples; the unusable seed fails alone.
    greedy = portal.call(text_of, engine.generate(odd_prompt, SamplingParams(max_tokens=16, temperature=0)))
    assert out["odd", 0] == greedy and out["odd", 1] == greedy
    assert out["odd", 2][1] in ("stop", "length")
    assert isinstance(out["odd", 3], EngineError)
    assert portal.call(wait_for_no_contexts, engine)["contexts"] == 0


def test_an_unknown_token_past_the_checks_fails_its_prefill_only(llm):
    """The front's vocabulary check is the contract's; past it, a batched prefill still fails one job."""
    portal, engine = llm
    normal = [chat(engine, f"Say the number {i}.") for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0)
    solo = [portal.call(text_of, engine.generate(p, params)) for p in normal]
    vocab = engine.vocab_size

    async def together():
        out: dict = {}

        async def one(key, tokens):
            out[key] = await text_of(engine.generate(tokens, params))

        async def unchecked(tokens):
            # Past the engine's own check (as if it had a bug): the batched prefill must still
            # fail only this job, retried one by one.
            from headrace.plugins.engines.llm.messages import Prefill, Reply

            reply = Reply()
            engine._commands.put(Prefill("unchecked", tokens, None, reply))
            try:
                await reply.wait()
            except EngineError as exc:
                out["unchecked"] = exc
            finally:
                await engine.free("unchecked")

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(normal):
                tg.start_soon(one, i, p)
            tg.start_soon(unchecked, normal[0][:-1] + [vocab + 10])
        return out

    out = portal.call(together)
    assert [out[i] for i in range(6)] == solo
    assert isinstance(out["unchecked"], EngineError) and "prefill failed" in str(out["unchecked"])
    engine.core.contexts.pop("unchecked", None)
    assert portal.call(wait_for_no_contexts, engine)["contexts"] == 0


@pytest.mark.parametrize(("death", "says"), [
    (SystemExit("a bug that escapes the core"), "worker thread stopped"),  # not an Exception: the thread ends
    # A core whose engine cannot go on (headrace-sglang: a process of SGLang's died) fails the engine, saying why.
    (EngineFailed("engine 'doomed': its scheduler process exited"), "its scheduler process exited"),
])
def test_a_dead_worker_fails_waiting_requests_and_the_engine(tmp_path, death, says):
    """A worker thread that dies (a bug past every isolation, or a core's EngineFailed) answers what waits on
    it, and run() raises."""
    env = EngineEnv(data_dir=tmp_path, cache_dir=Path.home() / ".cache" / "headrace", lookup=lambda name: None)
    engine = TorchLLM(EngineSpec(name="doomed", plugin="torch", options={"threads": 2}), env)
    with start_blocking_portal() as portal:
        future, _ = portal.start_task(engine.run)
        prompt = chat(engine, "Write a long essay about mountains.")
        decoding = anyio.Event()
        step = engine.core.step

        def step_then_die(out):
            if engine.core.stats()["decoding"] and decoding.is_set():
                raise death
            step(out)

        engine.core.step = step_then_die

        async def run():
            out: dict = {}

            async def decode():
                stream = engine.generate(prompt, SamplingParams(max_tokens=200, temperature=0))
                out["first"] = await stream.__anext__()
                decoding.set()
                out["decode"] = await outcome(stream)

            async def prefill():  # waits on a reply the dead worker never gives
                await decoding.wait()
                try:
                    await engine.prefill("late", prompt)
                    out["prefill"] = "filled"
                except EngineError as exc:
                    out["prefill"] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(decode)
                tg.start_soon(prefill)
            return out

        out = portal.call(run)
        with pytest.raises(EngineError, match=says):
            future.result(timeout=60)
    assert isinstance(out["decode"], EngineError) and "stopped" in str(out["decode"])
    # The prefill either ran before the worker died or was answered when it did: it never hangs.
    assert out["prefill"] == "filled" or "stopped" in str(out["prefill"])
    assert idle(engine.stats())


def test_a_shared_prefix_is_prefilled_once_and_decodes_as_uncached(llm):
    """Automatic prefix caching: a second prompt with the same 500-token prefix fills only its suffix."""
    portal, engine = llm
    core = engine.core
    first, second = prompts_on_a_shared_prefix(engine, 500)

    async def answer(tokens):
        return await text_of(engine.generate(tokens, GREEDY))

    core.prefix_cache.clear()
    uncached = portal.call(answer, second)
    core.prefix_cache.clear()
    portal.call(answer, first)  # fills the cache with the prefix
    before, hits_before = core.token_counts["prefill"], core.prefix_cache.stats.hits
    cached = portal.call(answer, second)
    filled = core.token_counts["prefill"] - before
    reused = core.prefix_cache.stats.hits - hits_before
    assert reused >= 500 - core.prefix_cache.block  # the prefix, to its last whole block
    assert filled == len(second) - reused and filled < len(second) - 480
    assert cached == uncached
    assert engine.stats()["prefix_cache_hits"] >= reused


def test_the_prefix_cache_stays_within_its_budget(llm):
    portal, engine = llm
    cache = engine.core.prefix_cache
    cache.clear()

    async def fill(n: int):
        for i in range(n):
            await text_of(engine.generate(chat(engine, f"Tell me fact number {i} about rivers. " * 8),
                                          SamplingParams(max_tokens=1, temperature=0)))

    saved, cache.capacity_tokens = cache.capacity_tokens, 256
    try:
        portal.call(fill, 6)
        assert 0 < cache.used_tokens <= 256 and cache.stats.evictions > 0
    finally:
        cache.capacity_tokens = saved
        cache.clear()


def test_prompts_queued_together_on_a_shared_prefix_compute_it_once(llm):
    """Four chats on one 300-token system prompt, queued at once: the prefix is filled once, then forked."""
    portal, engine = llm
    core = engine.core
    system = " ".join(f"Note {i}: the headrace feeds the wheel." for i in range(40))
    prompts = [engine.chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in ("Why?", "How fast?", "Where from?", "Since when?")]
    assert min(len(p) for p in prompts) > 300

    async def all_at_once():
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(text_of, engine.generate(p, SamplingParams(max_tokens=1, temperature=0)))

    core.prefix_cache.clear()
    before = core.token_counts["prefill"]
    portal.call(all_at_once)
    filled = core.token_counts["prefill"] - before
    assert filled < len(prompts[0]) + 3 * (len(prompts[0]) - 280)


# ----- logprobs (issue 14) ------------------------------------------------------------------


def test_logprobs_are_the_models_log_softmax(llm):
    portal, engine = llm
    check_logprobs_are_log_softmax(portal, engine, chat(engine, "Name a colour."), tolerance=1e-3)
