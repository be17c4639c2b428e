"""The prefix cache's bookkeeping: block hashes, longest match, LRU eviction within the token budget."""

from headrace.plugins.engines.kvreuse.prefix_cache import PinPolicy, PrefixCache, block_hashes


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


# ----- pins and eviction by next use (issue 28) ----------------------------------------------


class Clock:
    """The cache's clock, moved by hand: a TTL is a time, and a test should not sleep through it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pinning_cache(capacity: int = 8, pin_tokens: int = 8, **kw) -> tuple[PrefixCache[int], Clock]:
    clock = Clock()
    return PrefixCache(capacity_tokens=capacity, block=4, policy=PinPolicy(pin_tokens), clock=clock, **kw), clock


def test_a_pinned_prefix_outlives_traffic_that_evicts_it_under_lru():
    cache, _ = pinning_cache()
    cache.insert([1] * 4, lambda n: 1)
    assert cache.pin([1] * 4 + [0], ttl=10, owner="agent") == 4
    for q in (2, 3, 4):
        cache.insert([q] * 4, lambda n, q=q: q)
    assert cache.match([1] * 4 + [0], 4) is not None and cache.match([2] * 4, 4) is None
    assert (cache.pinned_tokens, cache.stats.evicted_lru) == (4, 2)


def test_a_pinned_context_still_answers_for_the_system_prompt_it_shares_once_fresher_holders_go():
    """One agent's pinned context fills the cache; another agent's turn is cached, is the freshest holder
    of the shared system prompt, and is evicted at once for room. The prompt must stay found in the
    pinned context (it was lost with the evicted entry's index, and every agent re-prefilled it)."""
    system = [7] * 8
    for shared in (True, False):
        cache, _ = pinning_cache(capacity=16, pin_tokens=16, shared_blocks=shared)
        cache.insert(system + [1] * 8, lambda n: 1)
        assert cache.pin(system + [1] * 8, ttl=10, owner="agent-1") == 16
        cache.insert(system + [2] * 4, lambda n: 2)  # no room beside the pin: evicted as it comes
        assert len(cache) == 1 and cache.stats.evicted_lru == 1
        found = cache.match(system + [3] * 4, 12)
        assert found is not None and (found[0].kv, found[1]) == (1, 8), shared


def test_a_pin_expires_at_its_ttl_and_the_entry_is_evictable_again():
    cache, clock = pinning_cache()
    cache.insert([1] * 4, lambda n: 1)
    cache.pin([1] * 4, ttl=5)
    clock.now = 4.9
    cache.insert([2] * 4, lambda n: 2)
    cache.insert([3] * 4, lambda n: 3)  # evicts 2, the oldest unpinned
    assert cache.match([1] * 4, 4) is not None and cache.pinned_tokens == 4
    clock.now = 5.0
    cache.insert([4] * 4, lambda n: 4)  # the pin expired on this insert: 1 is the least recently used
    assert cache.match([1] * 4, 4) is None
    assert (cache.pinned_tokens, cache.stats.pins_expired) == (0, 1)


def test_pins_never_exceed_their_budget_and_one_past_it_is_refused():
    cache, _ = pinning_cache(capacity=32, pin_tokens=8)
    for q in (1, 2, 3):
        cache.insert([q] * 4, lambda n, q=q: q)
    assert cache.pin([1] * 4, 10, owner="a") == 4 and cache.pin([2] * 4, 10, owner="b") == 4
    assert cache.pin([3] * 4, 10, owner="c") == 0  # 12 > 8: refused, the earlier pins kept
    assert (cache.pinned_tokens, cache.stats.pins_refused) == (8, 1)
    assert cache.pin([1] * 4, 20) == 4 and cache.pinned_tokens == 8  # a second pin of a pinned entry costs nothing


def test_a_program_holds_one_pin_and_unpinning_ends_it():
    cache, _ = pinning_cache(capacity=32, pin_tokens=32)
    cache.insert([1] * 4, lambda n: 1)
    cache.insert([1] * 4 + [2] * 4, lambda n: 2)  # the next turn: it supersedes turn 1's entry
    assert cache.stats.evicted_superseded == 1 and len(cache) == 1
    cache.insert([5] * 4, lambda n: 5)
    cache.pin([5] * 4, 10, owner="p")
    assert cache.pin([1] * 8, 10, owner="p") == 8 and cache.pinned_tokens == 8  # the turn before is unpinned
    cache.unpin("p")
    assert cache.pinned_tokens == 0 and cache.pinned_entries == 0


def test_the_entry_needed_furthest_ahead_goes_first_lru_among_equals():
    cache, clock = pinning_cache(capacity=12, pin_tokens=0)
    cache.insert([1] * 4, lambda n: 1)  # a program's context; its pin is refused (no budget) but it is predicted
    cache.pin([1] * 4, 10, owner="agent", next_use=1.0)  # back in 1 s
    clock.now = 2.0
    cache.insert([2] * 4, lambda n: 2)
    clock.now = 2.5
    cache.insert([3] * 4, lambda n: 3)
    clock.now = 3.0  # the agent is overdue: needed now; 2 was last used 1 s ago, 3 0.5 s ago
    cache.insert([4] * 4, lambda n: 4)
    assert cache.match([1] * 4, 4) is not None and cache.match([2] * 4, 4) is None
    assert cache.stats.evicted_next_use == 1  # LRU would have taken 1
    cache.unpin("agent")  # back to LRU: 1 is the least recently used
    cache.insert([5] * 4, lambda n: 5)
    assert cache.match([1] * 4, 4) is None and cache.stats.evicted_lru == 1


def test_pins_leave_one_slot_where_entries_are_bounded():
    cache, _ = pinning_cache(capacity=100, pin_tokens=100, max_entries=2)
    cache.insert([1] * 4, lambda n: 1)
    cache.insert([2] * 4, lambda n: 2)
    assert cache.pin([1] * 4, 10) == 4 and cache.pin([2] * 4, 10) == 0  # the last slot stays for new prompts
    cache.insert([3] * 4, lambda n: 3)
    assert cache.match([1] * 4, 4) is not None and cache.match([3] * 4, 4) is not None and len(cache) == 2


def test_the_retention_ttl_weighs_the_refill_and_is_clamped():
    policy = PinPolicy(100, ttl_factor=10.0, ttl_min=2.0, ttl_max=60.0)
    assert policy.retention_ttl(500, 1000.0) == 5.0
    assert policy.retention_ttl(10, 1000.0) == 2.0 and policy.retention_ttl(10_000, 1000.0) == 60.0
    assert policy.retention_ttl(500, None) == policy.retention_ttl(500, 1000.0)  # unmeasured: the default rate


def test_to_the_token_an_entry_keeps_its_partial_block_and_a_hit_reaches_into_it():
    cache: PrefixCache[str] = PrefixCache(capacity_tokens=1000, block=4, to_the_token=True)
    cache.insert(list(range(10)), lambda n: f"kv{n}")  # all 10 kept, the last 2 a partial block
    assert cache.used_tokens == 10
    entry, n = cache.match(list(range(10)), max_tokens=9)  # a repeated prompt: all but its last token
    assert (entry.kv, n) == ("kv10", 9)
    assert cache.match(list(range(9)) + [77], max_tokens=10)[1] == 9  # as far as the prompt agrees
    assert cache.match([0, 1, 2], max_tokens=3) is None  # no whole block: nothing to look up by
    cache.insert([5, 5], lambda n: "short")  # shorter than a block: not kept
    assert len(cache) == 1


def test_to_the_token_the_holder_that_goes_furthest_answers():
    cache: PrefixCache[str] = PrefixCache(capacity_tokens=1000, block=4, to_the_token=True)
    head = [7, 7, 7, 7]
    cache.insert(head + [1, 2, 3], lambda n: "long")
    cache.insert(head + [1, 9], lambda n: "other")  # the freshest holder of the head's block
    assert cache.match(head + [1, 2, 3, 4], max_tokens=8) == (cache.match(head + [1, 2, 3], 7)[0], 7)
    assert cache.match(head + [1, 2, 3, 4], max_tokens=8)[0].kv == "long"
    assert cache.match(head + [1, 9, 0], max_tokens=7)[0].kv == "other"


def test_block_aligned_unless_to_the_token():
    cache: PrefixCache[str] = PrefixCache(capacity_tokens=1000, block=4)
    cache.insert(list(range(10)), lambda n: f"kv{n}")
    assert cache.match(list(range(10)), max_tokens=9)[1] == 8 and cache.used_tokens == 8
