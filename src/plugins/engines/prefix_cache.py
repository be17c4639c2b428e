"""Automatic prefix caching: the KV of token-block prefixes, found by hash.

As vLLM's automatic prefix caching and Parrot's prefix matcher: a prompt is cut
into blocks of ``block`` tokens, each block's hash chains the hashes before it,
so one hash names a whole prefix. After a prefill the engine offers the
context's block-aligned prefix; a later prefill of any request (a plain chat
included) whose prompt starts with a cached prefix forks that KV and fills only
the rest. Entries hold at most ``capacity_tokens`` tokens together; the least
recently used go first.

Where entries share storage (``shared_blocks``: llama.cpp's unified KV, in which a cache sequence
forked from a context shares its cells with every sequence that context was forked from), a
block held by several entries is counted once: caching the same 1,000-token system prompt behind
a hundred different questions costs the prompt once plus each question's own blocks. Otherwise
(the torch core, whose entries hold their own tensors) every entry counts whole.

Engine-neutral: an entry's ``kv`` is whatever the engine stores (the torch core
keeps per-layer tensor views), made on demand by the factory given to ``insert``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

KV = TypeVar("KV")


def block_hashes(tokens: Sequence[int], block: int) -> list[int]:
    """The chained hash of every whole block of ``tokens``: entry ``i`` names ``tokens[: (i + 1) * block]``."""
    out, h = [], 0
    for end in range(block, len(tokens) + 1, block):
        h = hash((h, tuple(tokens[end - block : end])))
        out.append(h)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(eq=False)
class CachedPrefix(Generic[KV]):
    tokens: list[int]  # block-aligned
    kv: KV


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0  # of those, tokens found cached (vLLM's prefix_cache_hits)
    evictions: int = 0


@dataclass
class PrefixCache(Generic[KV]):
    capacity_tokens: int
    block: int = 16
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Called with an entry's kv as it leaves the cache (llama.cpp gives its sequence back); None: nothing to do.
    on_evict: Callable[[KV], None] | None = None
    shared_blocks: bool = False  # entries share a common prefix's storage: count each block once
    _entries: OrderedDict[int, CachedPrefix[KV]] = field(default_factory=OrderedDict)  # LRU order, by id
    _index: dict[int, CachedPrefix[KV]] = field(default_factory=dict)  # block hash -> an entry holding it
    _holders: dict[int, int] = field(default_factory=dict)  # block hash -> entries holding it (shared_blocks)
    used_tokens: int = 0

    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[CachedPrefix[KV], int] | None:
        """The longest cached block-aligned prefix of ``tokens`` of at most ``max_tokens`` tokens.

        Pure: counts nothing, so a scheduler may ask before it decides (``use`` counts a use).
        """
        hashes = block_hashes(tokens[: max(0, max_tokens)], self.block)
        for i in range(len(hashes) - 1, -1, -1):
            entry = self._index.get(hashes[i])
            n = (i + 1) * self.block
            if entry is not None and entry.tokens[:n] == list(tokens[:n]):  # a hash collision is no hit
                return entry, n
        return None

    def use(self, entry: CachedPrefix[KV] | None, looked_up: int, found: int) -> None:
        """Count one lookup of ``looked_up`` prompt tokens that reused ``found``; refresh the entry."""
        self.stats.queries += looked_up
        self.stats.hits += found
        if entry is not None and id(entry) in self._entries:
            self._refresh(entry)

    def insert(self, tokens: Sequence[int], make_kv: Callable[[int], KV]) -> None:
        """Offer a filled context's ``tokens``; its block-aligned prefix is kept (``make_kv(n)``: its first n tokens)."""
        n = len(tokens) // self.block * self.block
        if n == 0 or n > self.capacity_tokens:
            return
        found = self.match(tokens, n)
        if found is not None and found[1] == n:
            self._refresh(found[0])  # already cached whole
            return
        entry = CachedPrefix(list(tokens[:n]), make_kv(n))
        self._entries[id(entry)] = entry
        self._refresh(entry)
        self.used_tokens += self._charge(entry, +1)
        while self.used_tokens > self.capacity_tokens:
            self._evict(next(iter(self._entries.values())))

    def _charge(self, entry: CachedPrefix[KV], sign: int) -> int:
        """Tokens that ``entry`` adds (+1) to the cache, or frees (-1) as it leaves."""
        if not self.shared_blocks:
            return len(entry.tokens)
        changed = 0
        for h in block_hashes(entry.tokens, self.block):
            held = self._holders.get(h, 0) + sign
            if held > 0:
                self._holders[h] = held
            else:
                del self._holders[h]
            changed += (sign > 0 and held == 1) or held == 0  # the block's first holder came, or its last left
        return changed * self.block

    def _refresh(self, entry: CachedPrefix[KV]) -> None:
        # The most recently used holder of a shared prefix answers for it, so evicting the least
        # recently used entry never unindexes a prefix that a fresher entry still holds.
        self._entries.move_to_end(id(entry))
        for h in block_hashes(entry.tokens, self.block):
            self._index[h] = entry

    def evict_lru(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        self._evict(next(iter(self._entries.values())))
        return True

    def _evict(self, entry: CachedPrefix[KV]) -> None:
        del self._entries[id(entry)]
        self.used_tokens -= self._charge(entry, -1)
        self.stats.evictions += 1
        for h in block_hashes(entry.tokens, self.block):
            if self._index.get(h) is entry:
                del self._index[h]
        if self.on_evict is not None:
            self.on_evict(entry.kv)

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            if self.on_evict is not None:
                self.on_evict(entry.kv)
        self._entries.clear()
        self._index.clear()
        self._holders.clear()
        self.used_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)


def cache_stats(stats: PrefixCacheStats, cache: PrefixCache[Any] | None, capacity: int) -> dict[str, int]:
    """An engine's ``prefix_cache_*`` stats keys (what /metrics reads), its cache on or off."""
    return {"prefix_cache_queries": stats.queries, "prefix_cache_hits": stats.hits,
            "prefix_cache_tokens": cache.used_tokens if cache is not None else 0,
            "prefix_cache_capacity": capacity}
