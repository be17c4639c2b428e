"""The llama.cpp LLM engine on the real SmolLM2: sequences, forks, continuous batching, faults."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import psutil
import pytest
import torch

from conftest import check_logprobs_are_log_softmax, idle, prompts_on_a_shared_prefix
from llm_engines import chat, collect, outcomes, text_of, wait_for_no_contexts
from headrace.plugins.engines.llama_cpp.engine import LlamaCppLLM
from headrace.plugins.engines.llama_cpp.lazy_kv import resident_bytes
from headrace.plugins.engines.llama_cpp.batch import MIN_SHARED_SCORING_PREFIX, shared_prefix_groups
from headrace.plugins.engines.llm.front import EngineError
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup builds it)")

GREEDY = SamplingParams(max_tokens=24, temperature=0)
CACHE = Path.home() / ".cache" / "headrace"  # share the converted model with the server tests


def make_env(tmp: Path, batches: list | None = None) -> EngineEnv:
    return EngineEnv(
        data_dir=tmp,
        cache_dir=CACHE,
        lookup=lambda name: None,
        observe_batch=(lambda op, n, start, end: batches.append((op, n))) if batches is not None else
        (lambda op, n, start, end: None),
    )


def engine_spec(**options) -> EngineSpec:
    return EngineSpec(name="smollm2", plugin="llama-cpp", options={"threads": 2, **options})


@pytest.fixture
def llm(llama_cpp_smollm2):
    """The session's engine (default options) on its own event loop in a thread; tests call into it through the
    portal. Tests that need other options make their own."""
    portal, engine, _ = llama_cpp_smollm2
    return portal, engine


def test_unknown_and_bad_options_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['dtype', 'n_gpu'\]"):
        LlamaCppLLM(engine_spec(dtype="bfloat16", n_gpu=1), make_env(tmp_path))
    with pytest.raises(ValueError, match="quantize: unknown type 'Q3'"):
        LlamaCppLLM(engine_spec(quantize="Q3"), make_env(tmp_path))
    with pytest.raises(ValueError, match="n_seq_max: must be a positive integer"):
        LlamaCppLLM(engine_spec(n_seq_max=0), make_env(tmp_path))
    with pytest.raises(ValueError, match=r"engines.smollm2.options.stream_interval: must be a positive integer, not 0"):
        LlamaCppLLM(engine_spec(stream_interval=0), make_env(tmp_path))
    with pytest.raises(ValueError, match="preempt_max_pause_seconds: must be a number >= 0"):
        LlamaCppLLM(engine_spec(preempt_max_pause_seconds=-1), make_env(tmp_path))
    # Fewer batch tokens than sequences: llama.cpp would abort the process at load (GGML_ASSERT).
    with pytest.raises(ValueError, match=r"max_batch_tokens: must be at least the engine's 58 llama.cpp sequences"):
        LlamaCppLLM(engine_spec(n_seq_max=10, max_batch_tokens=16), make_env(tmp_path))


@pytest.mark.slow
def test_a_child_counts_its_parents_tokens_and_a_context_decodes_once(llm):
    """What the contract's bad-request test does not cover: llama.cpp's limits (its KV sequences)."""
    portal, engine = llm
    assert engine.vocab_size == len(engine.tokenizer) and engine.max_context_tokens == 2048

    async def run():
        await engine.prefill("parent", [1] * 2000)
        with pytest.raises(EngineError, match="the prompt is 2100 tokens"):  # the parent's tokens count too
            await engine.prefill("child", [2] * 100, parent="parent")
        await engine.free("parent")
        await engine.prefill("twice", [1, 2, 3])
        await text_of(engine.decode("twice", SamplingParams(max_tokens=2, temperature=0)))
        with pytest.raises(EngineError, match="has decoded already"):
            await text_of(engine.decode("twice", GREEDY))
        await engine.free("twice")
        return await wait_for_no_contexts(engine)

    assert portal.call(run)["contexts"] == 0


def test_shared_prefix_groups_pay_off():
    """One query's documents share the system prompt and the query; the next query starts its own group."""
    system = list(range(100, 130))
    a = [system + [1] * 40 + [1000 + i, 7, 8] for i in range(5)]  # query 1: 70 shared tokens
    b = [system + [2] * 40 + [2000 + i, 7, 8] for i in range(3)]  # query 2: shares only the system prompt with a
    alone = [list(range(500, 510))]
    groups = shared_prefix_groups(a + b + alone, 16)
    assert [(g.start, g.end, g.length) for g in groups] == [(0, 5, 70), (5, 8, 70), (8, 9, 0)]
    # A prefix always leaves the shorter prompt its last token (its logits are the score).
    groups = shared_prefix_groups([system + [5], system + [5, 6]], 16)
    assert [(g.start, g.end, g.length) for g in groups] == [(0, 2, 30)]
    assert shared_prefix_groups([system, list(range(30))], 16)[0].length == 0


@pytest.mark.slow
def test_scoring_prompts_prefill_their_shared_prefix_once(llm):
    """Documents of one query fork a prefill of the shared system prompt and query; scores are unchanged."""
    portal, engine = llm
    query = "Which of these rivers is the longest, and through which countries does it flow? " * 3
    docs = ["Nile: about 6650 km through eleven countries.", "Amazon: the largest by discharge.",
            "Danube: through ten countries, Germany to Romania.", "Rhine: from the Alps to the North Sea."]
    prompts = [chat(engine, f"Query: {query}\nDocument: {d}\nIs it relevant? Answer yes or no.") for d in docs]
    prompts.append(chat(engine, "Is fire cold? Answer yes or no."))  # shares only the template's start
    shared = min(len(p) for p in prompts[:-1]) - 1
    while any(p[:shared] != prompts[0][:shared] for p in prompts[:-1]):
        shared -= 1
    assert shared >= MIN_SHARED_SCORING_PREFIX
    yes, no = engine.encode("yes")[0], engine.encode("no")[0]
    before = engine.core.token_counts["score"]
    together = portal.call(engine.next_token_logits, prompts, [yes, no])
    used = engine.core.token_counts["score"] - before
    assert used == shared + sum(len(p) - shared for p in prompts[:-1]) + len(prompts[-1])
    alone = torch.cat([portal.call(engine.next_token_logits, [p], [yes, no]) for p in prompts])
    # The prefix's KV comes from another batch shape, and llama.cpp's quantized kernels round
    # activations per batch: close, not equal (as for any two batch shapes).
    assert torch.allclose(together, alone, rtol=0.05, atol=0.5)
    margin = lambda logits: logits[:, 0] - logits[:, 1]  # what the reranker scores by
    assert torch.allclose(margin(together), margin(alone), atol=0.5)
    assert portal.call(wait_for_no_contexts, engine)["contexts"] == 0


@pytest.mark.slow
def test_a_bad_token_id_past_the_checks_fails_its_prefill_only(llm):
    """The front's vocabulary check is the contract's; past it, llama.cpp's refusal still fails one prefill."""
    portal, engine = llm
    normal = [chat(engine, f"Say the number {i}.") for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0)
    vocab = engine.vocab_size

    # As if both checks had a bug: llama.cpp refuses the whole batch, and the engine retries it
    # part by part, so only the bad prefill fails.
    engine.core.vocab_size = vocab + 100
    try:
        out = portal.call(outcomes, engine, {**dict(enumerate(normal)), "unchecked": normal[0][:-1] + [vocab + 10]},
                          params)
    finally:
        engine.core.vocab_size = vocab
    assert all(isinstance(out[i], tuple) and out[i][0] for i in range(4))
    assert isinstance(out["unchecked"], EngineError) and "prefill failed" in str(out["unchecked"])
    assert portal.call(wait_for_no_contexts, engine)["contexts"] == 0


@pytest.mark.slow
def test_a_prefill_waits_for_a_free_sequence_then_gives_up_clearly(tmp_path):
    """Under load every sequence may be held: a prefill waits for one (not an error), within a bound."""
    engine = LlamaCppLLM(engine_spec(n_seq_max=2, n_ctx=512, max_batch_tokens=256, context_wait_seconds=1),
                         make_env(tmp_path))

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.prefill("a", [1, 2, 3])
            await engine.prefill("b", [1, 2, 3])
            started = anyio.Event()

            async def third():
                started.set()
                await engine.prefill("c", [4, 5, 6])

            async with anyio.create_task_group() as inner:
                inner.start_soon(third)
                await started.wait()
                while engine.stats()["waiting"] == 0:  # "c" is queued behind the two held sequences
                    await anyio.sleep(0.01)
                assert engine.stats()["contexts"] == 2
                await engine.free("a")  # frees a sequence: "c" gets it
            assert engine.stats()["contexts"] == 2
            # Nothing frees a sequence now: the wait ends in a clear error.
            with pytest.raises(EngineError, match="holds at most 2 contexts.*none was freed within 1 s"):
                await engine.prefill("d", [7, 8])
            for ctx in ("b", "c"):
                await engine.free(ctx)
            stats = await wait_for_no_contexts(engine)
            tg.cancel_scope.cancel()
        return stats

    async def run():
        with anyio.fail_after(600):
            return await scenario()

    assert idle(anyio.run(run))


@pytest.mark.slow
def test_the_kv_cells_take_memory_only_as_sequences_fill_them(tmp_path):
    """llama.cpp makes and zeroes every stream's cells at once (here 48 streams x 2,048 cells, 2.3 GB); the engine
    hands the buffer's pages back at once (issue 50), so memory follows the cells written."""
    # No prefix cache: its entry would hold a second copy of the prompt's cells; here only the prompt's own are
    # written.
    engine = LlamaCppLLM(engine_spec(n_seq_max=32, prefix_cache_tokens=0), make_env(tmp_path))
    process = psutil.Process()

    async def scenario():
        async with anyio.create_task_group() as tg:
            before = process.memory_info().rss
            await tg.start(engine.run)
            loaded = process.memory_info().rss, resident_bytes(engine.core.kv_released)
            prompt = chat(engine, "Rivers: Nile, Amazon, Yangtze, Danube, Rhine. " * 40 + "Which is the longest?")
            await engine.prefill("a", prompt)
            answer = await text_of(engine.decode("a", SamplingParams(max_tokens=8, temperature=0)))
            used = resident_bytes(engine.core.kv_released)  # while open: freed, its stream goes back too
            await engine.free("a")
            tg.cancel_scope.cancel()
        return before, loaded, used, answer, prompt

    before, (loaded, idle_kv), used_kv, answer, prompt = anyio.run(scenario)
    core = engine.core
    released = sum(end - start for start, end in core.kv_released)
    assert core.kv_buffer_bytes > 2_000_000_000 and released >= 0.99 * core.kv_buffer_bytes
    # The weights and buffers, not the cells: a tenth of the KV at most (without the release: all of it).
    assert loaded - before < 0.1 * core.kv_buffer_bytes and idle_kv == 0, (before, loaded, idle_kv)
    assert answer[0].strip()
    # A ~500-token prompt writes its stream's first cells: ~12 MB of KV in all layers, not its 2,048 cells' 47 MB.
    per_token = core.kv_buffer_bytes / core._n_ctx
    assert len(prompt) > 400 and len(prompt) * per_token <= used_kv < 1.5 * len(prompt) * per_token + 4_000_000, \
        (len(prompt), per_token, used_kv)


@pytest.mark.slow
def test_an_emptied_stream_gives_its_memory_back_and_the_streams_in_use_keep_theirs(tmp_path):
    """A stream per sequence: a freed context's stream and an evicted cache entry's go back to the kernel
    (lazy_kv.StreamLayout), while a context kept open through it all decodes exactly as the same prefill decoded
    before: the released pages are the emptied streams' and nobody else's. A cache hit copies the entry's cells,
    not its whole stream (2,048 cells, 47 MB)."""
    engine = LlamaCppLLM(engine_spec(n_seq_max=4), make_env(tmp_path))
    short = SamplingParams(max_tokens=8, temperature=0)

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            core = engine.core
            assert core._streams is not None
            rivers = chat(engine, "Rivers: Nile, Amazon, Yangtze, Danube, Rhine. " * 20 + "Which is the longest?")
            moons = chat(engine, "Moons: Io, Europa, Ganymede, Callisto, Titan. " * 20 + "Which is the largest?")
            await text_of(engine.generate(moons, short))  # caches the prompt
            # The same prefill twice (a cache hit, then the rest): the first decodes at once, the second after
            # other streams were filled, copied, freed and evicted around it.
            reference = await text_of(engine.generate(moons, short))
            await engine.prefill("kept", moons)
            for _ in range(2):  # a fresh prompt, then a cache hit: a whole-stream copy
                await text_of(engine.generate(rivers, short))
            hits = core.stats()["prefix_cache_hits"]
            await engine.set_prefix_caching(False)  # evicts every cached stream
            await text_of(engine.generate(chat(engine, "Hi"), SamplingParams(max_tokens=2, temperature=0)))
            await wait_for_no_contexts(engine, timeout=0.5)  # "kept" stays
            held = resident_bytes(core.kv_released)
            kept = await text_of(engine.decode("kept", short))
            await engine.free("kept")
            await text_of(engine.generate(chat(engine, "Hi"), SamplingParams(max_tokens=2, temperature=0)))
            await wait_for_no_contexts(engine)
            emptied = resident_bytes(core.kv_released)
            tg.cancel_scope.cancel()
        return reference, kept, hits, held, emptied, core.kv_buffer_bytes / core._n_ctx, len(moons)

    reference, kept, hits, held, emptied, per_token, moons_tokens = anyio.run(scenario)
    assert hits > 0
    assert kept == reference
    # Only the kept context's cells (a cache hit's copy of the prompt's, and the prompt's last token) and a page
    # or so a tensor elsewhere stay resident: ~10 MB. Without the release the cache entries and the other
    # contexts' copies kept more; with whole-stream copies the kept context alone held 47 MB.
    assert moons_tokens * per_token <= held < 1.5 * moons_tokens * per_token + 4_000_000, \
        (held, moons_tokens, per_token)
    assert emptied < 4_000_000, emptied


def test_a_first_token_goes_to_the_loop_before_the_decode_that_follows_it(tmp_path):
    """The first token is sampled from the prefill's logits at the start of an iteration: it is handed to the event
    loop before that iteration's llama_decode, not after it (a decode step of time to first token)."""
    engine = LlamaCppLLM(engine_spec(prefix_cache_tokens=0), make_env(tmp_path))
    handed: list[int] = []  # token ids handed to the loop so far
    at_decode: list[int] = []  # how many had been handed when each llama_decode began
    deliver = engine._deliver

    def counting(out):
        handed.extend(t for _, delta, _ in out.deltas if not isinstance(delta, BaseException) for t in delta.token_ids)
        return deliver(out)

    engine._deliver = counting

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            run = engine.core._run
            engine.core._run = lambda parts, out: (at_decode.append(len(handed)), run(parts, out))[1]
            text = await text_of(engine.generate(chat(engine, "Name a colour."),
                                                 SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
            tg.cancel_scope.cancel()
        return text

    assert anyio.run(scenario)
    # The prompt's decode, then one a generated token (the last one's is never run): the first token was out
    # before the second decode began, the second before the third.
    assert at_decode == [0, 1, 2], at_decode


def test_a_new_context_takes_the_sequence_that_keeps_the_decoding_ones_consecutive(tmp_path):
    """With a stream per sequence llama.cpp runs a batch as one ubatch per run of consecutive sequence ids: a new
    context takes the free id between two decoding ones, not the one freed last, and the three decode in one run."""
    engine = LlamaCppLLM(engine_spec(prefix_cache_tokens=0), make_env(tmp_path))
    runs: list[list[int]] = []  # the sequence ids of each decode-only batch
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            core = engine.core
            decode = core._decode
            core._decode = lambda parts: (runs.append(sorted(core._contexts[r.ctx].seq for p in parts
                                                                for r in p.rows)) if all(p.kind == "decode"
                                                                                         for p in parts) else None,
                                          decode(parts))[1]
            for ctx in "abcd":
                await engine.prefill(ctx, chat(engine, f"Tell me about the letter {ctx}."))
            seqs = {ctx: core._contexts[ctx].seq for ctx in "abcd"}
            assert sorted(seqs.values()) == [0, 1, 2, 3], seqs
            started = {"a": anyio.Event(), "c": anyio.Event()}

            async def decode_until_cancelled(ctx):
                async for _ in engine.decode(ctx, long):
                    started[ctx].set()

            tg.start_soon(decode_until_cancelled, "a")
            tg.start_soon(decode_until_cancelled, "c")
            await started["a"].wait()
            await started["c"].wait()
            await engine.free("b")
            await engine.free("d")  # freed last: a stack of free ids would hand it out next
            await engine.prefill("e", chat(engine, "Tell me about the letter e."))
            chosen = core._contexts["e"].seq
            runs.clear()
            async for _ in engine.decode("e", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
                pass
            tg.cancel_scope.cancel()
        return seqs, chosen

    seqs, chosen = anyio.run(scenario)
    assert chosen == seqs["b"], (seqs, chosen)
    three = [r for r in runs if len(r) == 3]
    assert three and all(r == list(range(r[0], r[0] + 3)) for r in three), runs


def test_the_model_loads_on_the_thread_that_decodes(tmp_path):
    """ggml's OpenMP teams belong to the thread that runs them, one parked pool per thread: loading (the AMX weight
    repack runs a team) on another thread left a second pool, and libgomp's waiters then stopped spinning (1,480
    futex calls a token against 784). Load and decodes run on one thread."""
    engine = LlamaCppLLM(engine_spec(prefix_cache_tokens=0), make_env(tmp_path))
    core, seen = engine.core, {}
    load, step = core.load, core.step
    core.load = lambda: (seen.setdefault("load", threading.get_ident()), load())[1]
    core.step = lambda out: (seen.setdefault("step", threading.get_ident()), step(out))[1]

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await text_of(engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0)))
            tg.cancel_scope.cancel()

    anyio.run(scenario)
    assert seen["load"] == seen["step"], seen


def test_too_many_contexts_and_a_full_kv_cache_are_clear_errors(tmp_path):
    # No prefix cache: a cached prefix would serve the 300 tokens below from b's 400.
    # A full KV cache happens only in a unified one (a stream per sequence holds a whole context).
    engine = LlamaCppLLM(engine_spec(n_seq_max=2, n_ctx=512, max_batch_tokens=256, context_wait_seconds=0,
                                     prefix_cache_tokens=0, kv_unified=True),
                         make_env(tmp_path))

    async def run():
        with anyio.fail_after(600):
            return await scenario()

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.prefill("a", [1, 2, 3])
            await engine.prefill("b", [1, 2, 3])
            with pytest.raises(EngineError, match="holds at most 2 contexts"):
                await engine.prefill("c", [1, 2, 3])
            await engine.free("b")
            await engine.prefill("b", [5] * 400)  # a's 3 cells and b's 400 of the 512
            await engine.free("a")
            with pytest.raises(EngineError, match="no room in the KV cache"):
                await engine.prefill("a", [5] * 300)
            await engine.free("b")
            await engine.prefill("a", [5] * 300)  # room again
            await engine.free("a")
            stats = await wait_for_no_contexts(engine)
            tg.cancel_scope.cancel()
        return stats

    assert anyio.run(run)["contexts"] == 0


def test_a_stream_per_sequence_bounds_a_context_by_its_share_of_n_ctx(tmp_path):
    # 2 contexts + 16 scoring + 8 cache sequences share 8,192 cells: llama.cpp gives each stream 8192 / 26,
    # padded to 256 cells, so a context holds at most 512 tokens; a longer prompt is a clear error.
    engine = LlamaCppLLM(engine_spec(n_seq_max=2, n_ctx=8192, max_batch_tokens=256, prefix_cache_sequences=8),
                         make_env(tmp_path))

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            assert engine.max_context_tokens == 512
            with pytest.raises(EngineError, match="the prompt is 600 tokens.* at most 512"):
                await engine.prefill("a", [5] * 600)
            await engine.prefill("a", [5] * 500)  # fits its stream
            await engine.free("a")
            stats = await wait_for_no_contexts(engine)
            tg.cancel_scope.cancel()
        return stats

    assert idle(anyio.run(scenario))


def test_a_prompt_is_copied_to_the_cache_after_its_first_token_once_and_read_before_that_from_its_context(tmp_path):
    """A filled prompt's cache entry is copied out of its context only when something reads it or the context goes:
    never before the first token, and once for a request nobody reused (its prompt's entry is superseded by its
    answer's). Read meanwhile (the same prompt again while the first still decodes), it is a hit on the context's
    cells, and answers as the first did."""
    engine = LlamaCppLLM(engine_spec(), make_env(tmp_path))
    events: list[str] = []
    deliver, core = engine._deliver, engine.core
    copy_cells = core._copy_cells
    core._copy_cells = lambda src, dst: (events.append("copy"), copy_cells(src, dst))[1]
    engine._deliver = lambda out: (events.extend("token" for _, d, _ in out.deltas if not isinstance(d, BaseException)),
                                   deliver(out))[1]
    answer = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            prompt = chat(engine, "Write a short poem about the sea.")
            await collect(engine.generate(prompt, answer))
            await wait_for_no_contexts(engine)
            alone = list(events)
            stats = engine.stats()
            events.clear()
            other = chat(engine, "Write a short poem about the moon.")
            async with anyio.create_task_group() as both:
                results = {}

                async def run(key, tokens, params):
                    results[key] = await collect(engine.generate(tokens, params))

                both.start_soon(run, "long", other, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                while "token" not in events:  # the moon prompt's entry, deferred, while it decodes
                    await anyio.sleep(0.005)
                before = core._cache_stats.hits
                await run("again", other, answer)
                hit = core._cache_stats.hits - before
            await wait_for_no_contexts(engine)
            tg.cancel_scope.cancel()
        return prompt, alone, stats, results, hit

    prompt, alone, stats, results, hit = anyio.run(scenario)
    assert alone.index("copy") > alone.index("token") and alone.count("copy") == 1, alone
    assert stats["prefix_cache_tokens"] == len(prompt) + 11, stats  # the prompt and its answer (not its last token)
    assert hit >= 16, hit
    assert results["again"][1] == results["long"][1][:12]


def test_a_shared_prefix_is_prefilled_once_and_decodes_as_uncached(llm):
    """Automatic prefix caching: a second prompt with the same 500-token prefix forks the cached sequence
    (seq_cp of its first positions) and fills only its own suffix."""
    portal, engine = llm
    core = engine.core
    first, second = prompts_on_a_shared_prefix(engine, 500)

    async def answer(tokens):
        return await text_of(engine.generate(tokens, GREEDY))

    async def switch(on: bool):
        await engine.set_prefix_caching(on)

    portal.call(switch, False)  # empties the cache
    portal.call(switch, True)
    uncached = portal.call(answer, second)
    portal.call(switch, False)
    portal.call(switch, True)
    portal.call(answer, first)  # fills the cache with the prefix
    before, hits = core.token_counts["prefill"], core.stats()["prefix_cache_hits"]
    cached = portal.call(answer, second)
    filled = core.token_counts["prefill"] - before
    reused = core.stats()["prefix_cache_hits"] - hits
    assert reused >= 500 - 16
    assert filled == len(second) - reused
    assert cached == uncached
    assert engine.prefix_caching_enabled()


def test_a_repeated_prompt_and_a_chats_next_turn_are_reused_to_the_token(llm):
    """As llama-server's slots: a prompt sent again prefills only its last token (whose logits the answer needs),
    not the rest of its last block; a finished answer is kept with its prompt, so a chat's next turn (the prompt,
    the answer, a new question) prefills only what follows the answer."""
    portal, engine = llm
    core = engine.core
    first = chat(engine, "Name three colours of the rainbow, then describe each one.")

    async def answer(tokens):
        return await collect(engine.generate(tokens, GREEDY))

    async def switch(on: bool):
        await engine.set_prefix_caching(on)

    def reuse(tokens) -> tuple[int, int, tuple]:
        before, hits = core.token_counts["prefill"], core.stats()["prefix_cache_hits"]
        out = portal.call(answer, tokens)
        return core.token_counts["prefill"] - before, core.stats()["prefix_cache_hits"] - hits, out

    portal.call(switch, False)  # empties the cache
    portal.call(switch, True)
    _, _, (text, _, _) = reuse(first)
    filled, reused, _ = reuse(first)
    assert len(first) % 16 and (filled, reused) == (1, len(first) - 1)
    turn = engine.chat_tokens([{"role": "user", "content": "Name three colours of the rainbow, then describe each one."},
                               {"role": "assistant", "content": text},
                               {"role": "user", "content": "Which of them is the warmest?"}])
    filled, reused, _ = reuse(turn)
    assert reused > len(first) + 8  # the answer's tokens too, not only the first prompt's
    assert filled == len(turn) - reused


def test_a_prompt_deferred_behind_a_shared_prefix_starts_when_that_fill_ends(tmp_path):
    """Two prompts on one 200-token prefix arrive together: the second waits for the first's fill so
    the prefix is computed once, and starts as soon as that fill ends, on an otherwise idle engine
    (it once slept until its context wait ran out: 120 s by default)."""
    engine = LlamaCppLLM(engine_spec(context_wait_seconds=600), make_env(tmp_path))

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            first, second = prompts_on_a_shared_prefix(engine, 200)
            hits = engine.core.stats()["prefix_cache_hits"]
            async with anyio.create_task_group() as both:
                both.start_soon(engine.prefill, "a", first)
                both.start_soon(engine.prefill, "b", second)
            reused = engine.core.stats()["prefix_cache_hits"] - hits
            for ctx in ("a", "b"):
                await engine.free(ctx)
            stats = await wait_for_no_contexts(engine)
            tg.cancel_scope.cancel()
        return reused, stats

    async def run():
        with anyio.fail_after(300):  # a hang guard, far below the 600 s wait it once sat out
            return await scenario()

    reused, stats = anyio.run(run)
    assert reused >= 200 - 16  # the second forked the first's prefix: it was deferred, not filled alongside
    assert stats["contexts"] == 0


def test_cached_prefixes_give_their_cells_back_when_the_kv_is_full(tmp_path):
    # Only a unified KV fills up: a stream per sequence holds a whole context.
    engine = LlamaCppLLM(engine_spec(n_seq_max=2, n_ctx=512, max_batch_tokens=256, kv_unified=True), make_env(tmp_path))

    async def scenario():
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            await engine.prefill("b", [5] * 400)
            await engine.free("b")  # its 400 cells stay, held by the cached prefix
            assert engine.stats()["prefix_cache_tokens"] == 400
            await engine.prefill("a", [7] * 300)  # 112 cells free: the cache is dropped, then it fits
            stats = engine.stats()
            await engine.free("a")
            tg.cancel_scope.cancel()
        return stats

    async def run():
        with anyio.fail_after(600):
            return await scenario()

    stats = anyio.run(run)
    assert stats["contexts"] == 1 and stats["prefix_cache_tokens"] == 300  # only a's prompt now, to the token


# ----- logprobs (issue 14) ------------------------------------------------------------------


def test_logprobs_are_the_models_log_softmax(llm):
    portal, engine = llm
    check_logprobs_are_log_softmax(portal, engine, chat(engine, "Name a colour."), tolerance=0.05)


# ----- preemption (issue 28 item 2: Autellix's PLAS pauses low-rank decodes) --------------------------

LOW_TOKENS = 24  # each low-rank row's output: more steps than the urgent request needs to get in


def counting(engine, start: int) -> list[int]:
    """A raw-text count the model goes on counting (its next tokens are sure, so greedy output is stable)."""
    return engine.encode(", ".join(str(n) for n in range(start, start + 12)) + ",")


async def low_rank_rows_and_an_urgent_request(engine, *, prefill, decode, urgent) -> tuple[list, list, dict]:
    """Eight low-rank contexts are prefilled, then decode together, filling the batch's eight row slots
    (``max_batch_tokens`` 16, set here once they are prefilled); once all eight decode, an urgent chat
    comes. ``prefill(i, ctx, tokens)``, ``decode(i, ctx, params)`` and ``urgent(tokens, params)`` make the
    calls. Returns the low rows' token ids, the events in order (("urgent first", the tokens each low row
    had then), ("low done", i)), and the core's stats after."""
    core = engine.core
    params = SamplingParams(max_tokens=LOW_TOKENS, temperature=0)
    contexts = [engine.new_context_id() for _ in range(8)]
    produced, outputs, events = [0] * 8, [[] for _ in range(8)], []

    async def one_low(i: int) -> None:
        async for delta in decode(i, contexts[i], params):
            outputs[i] += delta.token_ids
            produced[i] = len(outputs[i])
            if delta.finish_reason is not None:
                assert delta.finish_reason == "length"  # the scenario needs rows that run their full length
                events.append(("low done", i))

    async def one_urgent() -> None:
        async for _ in urgent(chat(engine, "Name a colour."), SamplingParams(max_tokens=4, temperature=0)):
            if not any(e[0] == "urgent first" for e in events):
                events.append(("urgent first", list(produced)))

    saved = core.max_batch_tokens
    with anyio.fail_after(300):
        try:
            async with anyio.create_task_group() as tg:
                for i, ctx in enumerate(contexts):
                    tg.start_soon(prefill, i, ctx, counting(engine, 100 * i))
            core.max_batch_tokens = 16  # eight row slots (// 2); the worker is idle, llama.cpp's buffers stay larger
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one_low, i)
                while core.stats()["decoding"] < 8:
                    await anyio.sleep(0.005)
                tg.start_soon(one_urgent)
        finally:
            core.max_batch_tokens = saved
    for ctx in contexts:
        await engine.free(ctx)  # a context decoded outside the scheduler stays until freed
    return outputs, events, await wait_for_no_contexts(engine)


@pytest.mark.slow
def test_las_pauses_low_rank_decodes_for_a_new_program_and_they_resume_unchanged(llm):
    """A new one-call program under ``las`` pauses an agent's running decodes (KV kept) to get in: its
    prefill takes the tokens they held, its decode a row slot they held. Without preemption (``fifo``; or
    the same priorities without the ``preemptive`` flag) it waits for a row to finish. The paused rows
    resume as the same rows: their greedy output is the unpaused one, token for token."""
    from headrace.batching.llm import LLMScheduler
    from headrace.batching.llm_policies import FifoLLMPolicy, LasLLMPolicy
    from headrace.batching.meta import PrimitiveMeta

    portal, engine = llm
    core = engine.core

    def agent(i: int) -> PrimitiveMeta:  # one long program: 50,000 tokens served already (a 50 s handicap)
        return PrimitiveMeta(run=f"agent-turn-{i}", node="llm", program="key:agent", attained_tokens=50_000)

    def scheduled(policy) -> dict:
        sched = LLMScheduler(engine, max_running=64, policy=policy)
        return {"prefill": lambda i, ctx, tokens: sched.prefill(ctx, tokens, meta=agent(i)),
                "decode": lambda i, ctx, params: sched.decode(ctx, params, agent(i)),
                "urgent": lambda tokens, params: sched.generate(tokens, params, PrimitiveMeta(run="chat", node="llm"))}

    by_priority = {"prefill": lambda i, ctx, tokens: engine.prefill(ctx, tokens, priority=1000 + i),
                   "decode": lambda i, ctx, params: engine.decode(ctx, params, priority=1000 + i),
                   "urgent": lambda tokens, params: engine.generate(tokens, params, priority=0)}

    async def scenario(calls: dict) -> tuple[list, list, dict, int]:
        before = core.stats()["preemptions"]
        outputs, events, stats = await low_rank_rows_and_an_urgent_request(engine, **calls)
        return outputs, events, stats, stats["preemptions"] - before

    async def switch(on: bool) -> None:
        await engine.set_prefix_caching(on)

    portal.call(switch, False)  # every run prefills its prompts the same way
    try:
        runs = {name: portal.call(scenario, calls) for name, calls in
                (("fifo", scheduled(FifoLLMPolicy())), ("priority only", by_priority),
                 ("las", scheduled(LasLLMPolicy())))}
    finally:
        portal.call(switch, True)
    for name, (outputs, events, stats, pauses) in runs.items():
        assert idle(stats) and stats["paused"] == 0, name
        urgent_at = next(k for k, e in enumerate(events) if e[0] == "urgent first")
        first_done = next(k for k, e in enumerate(events) if e[0] == "low done")
        if name == "las":
            # Its first token came while every low-rank row was still running, short of its length.
            assert urgent_at < first_done and max(events[urgent_at][1]) < LOW_TOKENS, (events, pauses)
            # All eight paused for its prefill (it wants more tokens than they leave it), and one more
            # for its decode's row slot.
            assert pauses >= 8 + 1, (events, pauses)
        else:
            # No preemption: the urgent request's decode waits for a row slot, which a finished row frees.
            assert pauses == 0 and first_done < urgent_at, (name, events, pauses)
    # Paused and resumed, the rows' greedy output is the unpaused one.
    assert runs["las"][0] == runs["fifo"][0] == runs["priority only"][0]
    assert all(len(ids) == LOW_TOKENS for ids in runs["las"][0])


@pytest.mark.slow
def test_a_program_attains_the_tokens_the_engine_computed_not_the_cache_hits_it_resent(llm):
    """``las`` counts service as the engine computed it: an agent's next turn resends its whole history,
    which the prefix cache holds, so the program attains the new prompt tokens and the generated ones,
    not the resent ones. Both ways a request reaches the engine tell the hits: a prefill then a decode (a
    route's request; the prefill answers them) and a generate (the engine's first delta carries them)."""
    import uuid

    from headrace.batching.llm import LLMScheduler
    from headrace.batching.llm_policies import LasLLMPolicy
    from headrace.batching.meta import PrimitiveMeta

    portal, engine = llm
    block = engine.core.prefix_cache.block
    sched = LLMScheduler(engine, max_running=8, policy=LasLLMPolicy())
    meta = PrimitiveMeta(run=f"agent-{uuid.uuid4().hex}", node="llm")
    params = SamplingParams(max_tokens=4, temperature=0)

    async def turn(tokens: list[int], split: bool) -> tuple[list[int], int, int]:
        """The turn's generated ids, the cached tokens its first delta reports, and the service it added."""
        before = sched.served.attained(meta.run)
        if split:
            ctx = engine.new_context_id()
            await sched.prefill(ctx, tokens, meta=meta)
            deltas = sched.decode(ctx, params, meta)
        else:
            deltas = sched.generate(tokens, params, meta)
        ids, cached = [], []
        async for delta in deltas:
            ids += delta.token_ids
            cached.append(delta.cached_tokens)
        assert cached[1:] == [0] * (len(cached) - 1)  # the first delta's alone
        return ids, cached[0], sched.served.attained(meta.run) - before

    def new_tokens(i: int) -> list[int]:
        return engine.encode(f" Tool result {i}: the record was found and the order shipped on Monday.")

    history = engine.encode(f"Agent {uuid.uuid4().hex}. " + " ".join(
        f"Step {i}: it looked up record {i * 7} and noted the result." for i in range(40)))
    out, cached, served = portal.call(turn, history, False)
    assert cached == 0 and served == len(history) + len(out)  # a fresh prompt: all of it computed
    for i, split in enumerate((True, False)):
        prompt = history + out + new_tokens(i)  # the next turn resends everything so far
        out, cached, served = portal.call(turn, prompt, split)
        assert cached >= (len(history) // block) * block, (split, cached, len(history))
        assert served == len(prompt) - cached + len(out), split
        assert served < len(prompt) // 4, (split, served, len(prompt))  # far less than the prompt sent
        history = prompt
