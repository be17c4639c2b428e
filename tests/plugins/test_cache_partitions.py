"""Cache partitions (issue 50, ``IsolatesCaches``): a prompt cached in one partition is no hit in another, in the
prefix cache, the KV tiers and their files after a restart; within one partition it is. The caches on their own,
then both built-in engines on the real SmolLM2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import pytest
import torch

from llm_engines import text_of
from headrace.plugins.engines.kvreuse.kv_store import KVStore, block_digests
from headrace.plugins.engines.llm.messages import EngineError
from headrace.plugins.engines.kvreuse.prefix_cache import PrefixCache, block_hashes
from headrace.plugins.protocols import IsolatesCaches, SamplingParams, ScoresThroughCache

from test_engine_tiers import make_engine, prompts, serve

A, B, C = "a" * 32, "b" * 32, "c" * 32  # partitions, as the daemon names them (digests)
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


# ----- the caches on their own --------------------------------------------------------------------


def test_a_prefix_cached_in_one_partition_answers_only_that_partition():
    cache: PrefixCache[str] = PrefixCache(1000, block=16)
    prompt = tokens(1, 100)
    cache.insert(prompt, lambda n: "a", partition=A)
    assert cache.match(prompt, 99, A)[1] == 96
    assert cache.match(prompt, 99, B) is None and cache.match(prompt, 99) is None
    assert block_hashes(prompt, 16, A)[0] != block_hashes(prompt, 16, B)[0] != block_hashes(prompt, 16)[0]
    # The same tokens in another partition are an entry of their own, neither superseding the other.
    cache.insert(prompt + tokens(2, 16), lambda n: "b", partition=B)
    assert len(cache) == 2 and cache.match(prompt, 99, A)[0].kv == "a" and cache.match(prompt, 99, B)[0].kv == "b"
    # A pin reaches only its partition's entry.
    cache.policy = type(cache.policy)(pin_tokens=500)
    assert cache.pin(prompt, 60, partition=B) == 112 and cache.match(prompt, 99, A)[0].pins == {}


def test_the_tiers_keep_partitions_apart_and_a_restart_keeps_them_apart(tmp_path: Path):
    def store() -> KVStore:
        return KVStore("model-a f16", 16, 1 << 20, tmp_path, 1 << 20)

    first = store()
    prompt = tokens(3, 64)
    first.put(prompt, bytearray(b"a" * 100), A)
    first.put(prompt, bytearray(b"s" * 100))  # the shared partition holds the same tokens too
    assert first.holds(prompt, A) and first.holds(prompt) and not first.holds(prompt, B)
    assert first.match(prompt, 64, B) is None
    first.close()
    names = sorted(p.name for p in tmp_path.glob("*.kv"))
    assert names == sorted(f"{block_digests(prompt, 16, p)[-1].hex()}.kv" for p in (A, ""))
    headers = [json.loads(p.read_bytes()[12: 12 + int.from_bytes(p.read_bytes()[8:12], "little")])
               for p in tmp_path.glob("*.kv")]
    assert sorted(h["partition"] for h in headers) == ["", A]  # what a restart reads back

    second = store()  # a restart: the files' headers say whose they are
    assert second.files_dropped == 0 and len(second) == 2
    assert second.match(prompt, 64, B) is None
    hit = second.match(prompt, 64, A)
    assert hit.tier == "disk" and second.payload(hit) == bytearray(b"a" * 100)
    assert second.payload(second.match(prompt, 64)) == bytearray(b"s" * 100)
    second.close()


# ----- both engines ---------------------------------------------------------------------------------


@pytest.fixture(params=["llama-cpp", "torch"])
def plugin(request) -> str:
    return request.param


async def cached(engine, prompt: list[int], partition: str = "") -> int:
    """The prompt tokens a prefill of ``prompt`` in ``partition`` found cached."""
    ctx = engine.new_context_id()
    found = await engine.prefill(ctx, prompt, **({"cache_partition": partition} if partition else {}))
    await engine.free(ctx)
    return found or 0


def test_an_engine_reuses_cached_kv_only_within_its_partition(tmp_path, plugin):
    engine = make_engine(plugin, tmp_path, kv_disk_mib=0)
    assert isinstance(engine, IsolatesCaches) and engine.isolates_caches

    async def scenario():
        a, _ = prompts(engine)
        # All but its last token whole blocks: the cells (to the token on llama-cpp) and the tiers (whole blocks)
        # reuse the same count.
        a = a[: (len(a) - 1) // 16 * 16 + 1]
        primed = await cached(engine, a, A)
        across = [await cached(engine, a, B), await cached(engine, a)]  # another's, and the shared partition
        hits_before = engine.stats()["prefix_cache_hits"]
        within = await cached(engine, a, A)
        text = await text_of(engine.generate(a, GREEDY, cache_partition=B))  # B's own copy now: a hit for B
        again = await cached(engine, a, B)
        with pytest.raises(EngineError, match="cache_partition"):
            await engine.prefill(engine.new_context_id(), a, cache_partition=3)
        return a, primed, across, hits_before, within, text, again, engine.stats()

    a, primed, across, hits_before, within, text, again, stats = anyio.run(serve, engine, scenario)
    block = (len(a) - 1) // 16 * 16
    assert primed == 0 and across == [0, 0]
    assert within == block and again == block and text[2] > 0
    assert stats["prefix_cache_hits"] - hits_before == 3 * block  # within, the generate, again


def test_an_evicted_prefix_is_restored_only_into_its_partition_after_a_restart_too(tmp_path):
    plugin = "llama-cpp"  # the tiers are engine-neutral (above); llama.cpp's restart is the costly path
    first = make_engine(plugin, tmp_path)

    async def before_restart():
        a, b = prompts(first)
        await cached(first, a, A)
        await cached(first, b, A)  # b's prefix takes the one cache sequence: a's goes to the host tier
        host = [await cached(first, a, C), await cached(first, a, A)]
        return a, host, first.stats()

    a, host, stats = anyio.run(serve, first, before_restart)
    block = (len(a) - 1) // 16 * 16
    assert host == [0, block] and stats["kv_store_host_hits"] == 1  # C: no tier hit; A: restored

    second = make_engine(plugin, tmp_path)  # stopping wrote every cached prefix to disk, with its partition

    async def after_restart():
        return [await cached(second, a, B), await cached(second, a)], second.stats(), await cached(second, a, A)

    across, stats, within = anyio.run(serve, second, after_restart)
    assert across == [0, 0] and stats["kv_store_disk_hits"] == 0 and stats["kv_store_host_hits"] == 0
    assert within == block


def test_scoring_through_the_cache_restores_a_document_scored_before_only_within_its_partition(tmp_path, plugin):
    """``ScoresThroughCache`` (llm-rerank's ``document_first``): a document scored for one query is restored, not
    computed, when it is scored for the next, in its own partition only; the scores are plain scoring's."""
    engine = make_engine(plugin, tmp_path, kv_disk_mib=0)
    assert isinstance(engine, ScoresThroughCache) and engine.scores_through_cache
    doc = " ".join(f"Note {i} on the mill wheel: it was checked and found sound." for i in range(20))

    def judged(query: str) -> list[int]:
        return engine.chat_tokens([{"role": "user", "content": f"Document: {doc}\nQuery: {query}\n"
                                    "Is the document relevant to the query? Answer yes or no."}])

    async def scenario():
        first, second = judged("What was checked?"), judged("Is bread baked here?")
        ids = engine.encode("yes") + engine.encode("no")
        plain = await engine.next_token_logits([first, second], ids)
        cold = await engine.next_token_logits_cached([first], ids, cache_partition=A)
        warm = await engine.next_token_logits_cached([second], ids, cache_partition=A)
        other = await engine.next_token_logits_cached([second], ids, cache_partition=B)
        await engine.heartbeat()  # after the frees: commands run in order
        return first, second, plain, cold, warm, other, engine.stats()

    first, second, plain, (cold, cold_cached), (warm, warm_cached), (other, other_cached), stats = anyio.run(
        serve, engine, scenario)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 200  # the document
    assert cold_cached == 0 and other_cached == 0
    assert shared // 16 * 16 <= warm_cached <= shared  # whole blocks at least (torch's granularity)
    margin = lambda logits: logits[:, 0] - logits[:, 1]  # what the reranker scores by
    # Restored KV came from another batch shape (llama.cpp rounds activations per batch): close, not equal.
    for scored, row in ((cold, 0), (warm, 1), (other, 1)):
        assert scored.shape == (1, 2)
        assert torch.allclose(margin(scored), margin(plain[row : row + 1]), atol=0.5)
    assert stats["contexts"] == 0  # every scoring context freed
