"""The prefix cache's bookkeeping: block hashes, longest match, LRU eviction within the token budget."""

from headrace.plugins.engines.prefix_cache import PrefixCache, block_hashes


def test_block_hashes_name_whole_prefixes():
    a, b = list(range(40)), list(range(32)) + [99] * 8
    assert len(block_hashes(a, 16)) == 2  # the last 8 tokens make no whole block
    assert block_hashes(a, 16) == block_hashes(b, 16)
    assert block_hashes(list(range(1, 17)), 16) != block_hashes(list(range(16)), 16)


def test_the_longest_block_aligned_prefix_matches_within_the_limit():
    cache: PrefixCache[str] = PrefixCache(capacity_tokens=1000, block=4)
    cache.insert(list(range(10)), lambda n: f"kv{n}")  # keeps 8 tokens
    entry, n = cache.match(list(range(9)) + [77], max_tokens=9)
    assert (entry.kv, n) == ("kv8", 8)
    assert cache.match(list(range(9)), max_tokens=7)[1] == 4  # at most 7: whole blocks only
    assert cache.match([5, 6, 7, 8, 9], max_tokens=5) is None
    cache.use(entry, 10, 8)
    assert (cache.stats.queries, cache.stats.hits) == (10, 8)


def test_least_recently_used_prefixes_go_first():
    cache: PrefixCache[int] = PrefixCache(capacity_tokens=8, block=4)
    cache.insert([1, 1, 1, 1], lambda n: 1)
    cache.insert([2, 2, 2, 2], lambda n: 2)
    cache.use(cache.match([1, 1, 1, 1, 0], 4)[0], 5, 4)  # 1 is fresher now
    cache.insert([3, 3, 3, 3], lambda n: 3)
    assert cache.match([2, 2, 2, 2, 0], 4) is None
    assert cache.match([1, 1, 1, 1, 0], 4) is not None and cache.used_tokens == 8
    assert cache.stats.evictions == 1


def test_a_shared_prefix_stays_found_while_any_holder_lives():
    cache: PrefixCache[str] = PrefixCache(capacity_tokens=16, block=4)
    system = [7, 7, 7, 7]
    cache.insert(system + [1, 1, 1, 1], lambda n: "a")
    cache.insert(system + [2, 2, 2, 2], lambda n: "b")
    cache.use(cache.match(system + [1, 1, 1, 1, 0], 8)[0], 9, 8)  # "a" used last
    cache.insert(system + [3, 3, 3, 3], lambda n: "c")  # evicts "b"
    assert cache.match(system + [9], 4)[1] == 4
    assert len(cache) == 2


def test_a_prompt_already_cached_whole_is_not_stored_twice():
    cache: PrefixCache[str] = PrefixCache(capacity_tokens=100, block=4)
    cache.insert(list(range(8)), lambda n: "x")
    cache.insert(list(range(8)) + [1], lambda n: "y")
    assert len(cache) == 1 and cache.used_tokens == 8


def test_evicted_entries_are_handed_back():
    freed: list[str] = []
    cache: PrefixCache[str] = PrefixCache(capacity_tokens=8, block=4, on_evict=freed.append)
    cache.insert([1] * 4, lambda n: "one")
    cache.insert([2] * 4, lambda n: "two")
    cache.insert([3] * 4, lambda n: "three")
    assert freed == ["one"]
    assert cache.evict_lru() and freed == ["one", "two"]
    cache.clear()
    assert freed == ["one", "two", "three"] and not cache.evict_lru()


def test_with_shared_blocks_a_system_prompt_behind_many_questions_counts_once():
    """llama.cpp's cache sequences share a common prefix's cells: 3 questions behind one 8-token system
    prompt hold 8 + 3 x 4 tokens, where entries that each count whole would hold 36 and evict."""
    system = [7] * 8
    shared: PrefixCache[str] = PrefixCache(capacity_tokens=24, block=4, shared_blocks=True)
    whole: PrefixCache[str] = PrefixCache(capacity_tokens=24, block=4)
    for cache in (shared, whole):
        for q in (1, 2, 3):
            cache.insert(system + [q] * 4, lambda n, q=q: f"q{q}")
    assert (shared.used_tokens, len(shared), shared.stats.evictions) == (20, 3, 0)
    assert (whole.used_tokens, len(whole), whole.stats.evictions) == (24, 2, 1)
    # Leaving, an entry frees only what no other entry holds; the last holder frees the prompt too.
    assert shared.evict_lru() and shared.used_tokens == 16
    assert shared.evict_lru() and shared.evict_lru() and shared.used_tokens == 0
    assert shared.match(system, 8) is None
