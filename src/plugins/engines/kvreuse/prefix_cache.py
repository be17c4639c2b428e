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

Pins and eviction by next use (issue 28, after Continuum and KVFlow):

- ``pin`` holds the entry that caches the longest prefix of some tokens for a time-to-live, under a
  key: a program's id (retention across a tool call; one pin per program, a new one replaces its
  last) or, for a client's ``cache_control`` mark, the entry itself (pins of one entry merge, the
  later expiry wins). A pinned entry is never evicted. Expired pins go lazily, on the next insert,
  lookup, pin or eviction. Pinned entries hold at most ``policy.pin_tokens`` tokens (each counted
  whole, an upper bound where blocks are shared) and never the last of ``max_entries`` slots; a pin
  past that is refused, not made room for: an earlier pin is a promise for its TTL, and the refused
  entry stays cached as any other.
- Among unpinned entries the one needed furthest ahead goes first. A retained program's entry is
  needed when the program is predicted back (``next_use``: its measured tool time; its pin may have
  expired or been refused); any other entry is predicted, as LRU does, to be needed again as far
  ahead as it was last used behind. Ties go least recently used first, so with no predictions this
  is plain LRU.
- An unpinned entry whose tokens begin a newly inserted one is dropped (superseded): every lookup it
  would answer, the new one answers.

Reuse to the token (``to_the_token``, the llama.cpp engine's, as llama-server's slots): an entry keeps its
last partial block, and a hit reaches past the last whole block into it as far as the prompt still agrees
with the entry, so a repeated prompt or a chat's next turn prefills only what is new, not the rest of a
block. Lookups still go by whole blocks' hashes; an entry shorter than a block is not kept.

Partitions (issue 50, vLLM's ``cache_salt``): every entry belongs to one, a string the request names (its
API key's and salt's digest; "" the shared one); a lookup, insert or pin reaches only its own. The
partition seeds the first block's hash, as vLLM hashes the salt into its first block, so the same tokens
of two partitions are two entries (each charged for its blocks) and never answer for each other.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

KV = TypeVar("KV")
BLOCK = 16  # tokens a block: a cached prefix is a whole number of them
# Tokens a second an engine is taken to (re)fill before it has measured its own (``LLMCore.tokens_per_second``).
DEFAULT_TOKENS_PER_SECOND = 1000.0


def block_hashes(tokens: Sequence[int], block: int, partition: str = "") -> list[int]:
    """The chained hash of every whole block of ``tokens``: entry ``i`` names ``tokens[: (i + 1) * block]``
    in ``partition``."""
    out, h = [], hash(("partition", partition)) if partition else 0
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
    tokens: list[int]  # block-aligned, but with ``to_the_token``
    kv: KV
    last_used: float = 0.0  # the cache's clock
    pins: dict[str, float] = field(default_factory=dict)  # pin key -> when it expires
    owner: str | None = None  # the program that retained it: its predicted return ranks the entry's eviction
    partition: str = ""  # the requests that may reuse it (module docstring)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0  # of those, tokens found cached (vLLM's prefix_cache_hits)
    evictions: int = 0  # all of those below
    evicted_lru: int = 0  # the least recently used went (no prediction placed another before it)
    evicted_next_use: int = 0  # a prediction chose another than the least recently used
    evicted_superseded: int = 0  # a longer entry holding all its tokens came
    pins: int = 0  # pins made (or renewed)
    pins_expired: int = 0
    pins_refused: int = 0  # the pin budget was full


@dataclass(frozen=True)
class PinPolicy:
    """How much may be pinned, and the retention TTL: ``clamp(ttl_factor * tokens / tokens_per_second,
    ttl_min, ttl_max)``: a context that would take longer to fill again is held longer; the budget
    bounds the memory all pins hold together."""

    pin_tokens: int = 0  # 0: no pins
    ttl_factor: float = 10.0
    ttl_min: float = 2.0
    ttl_max: float = 120.0

    def retention_ttl(self, tokens: int, tokens_per_second: float | None) -> float:
        rate = tokens_per_second if tokens_per_second and tokens_per_second > 0 else DEFAULT_TOKENS_PER_SECOND
        return min(self.ttl_max, max(self.ttl_min, self.ttl_factor * tokens / rate))


def pin_policy(opts: dict[str, Any], key: str, cache_tokens: int) -> PinPolicy:
    """Pop an engine's pin options from ``opts`` (``[engines.options]``), checking each; the budget defaults
    to a quarter of the prefix cache."""
    def number(name: str, default: float) -> float:
        value = opts.pop(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{key}.{name}: must be a number >= 0, not {value!r}")
        return float(value)
    pin_tokens = opts.pop("prefix_cache_pin_tokens", cache_tokens // 4)
    if isinstance(pin_tokens, bool) or not isinstance(pin_tokens, int) or not 0 <= pin_tokens <= max(0, cache_tokens):
        raise ValueError(f"{key}.prefix_cache_pin_tokens: must be an integer from 0 to prefix_cache_tokens "
                         f"({cache_tokens}), not {pin_tokens!r}")
    policy = PinPolicy(pin_tokens, number("pin_ttl_factor", 10.0), number("pin_ttl_min_seconds", 2.0),
                       number("pin_ttl_max_seconds", 120.0))
    if policy.ttl_min > policy.ttl_max:
        raise ValueError(f"{key}.pin_ttl_min_seconds: must not exceed pin_ttl_max_seconds")
    return policy


@dataclass
class PrefixCache(Generic[KV]):
    capacity_tokens: int
    block: int = BLOCK
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Called with an entry's kv as it leaves the cache (llama.cpp gives its sequence back); None: nothing to do.
    on_evict: Callable[[KV], None] | None = None
    # Called with an entry and why (an eviction reason, or "cleared") just before ``on_evict``, while its kv
    # still holds: an engine saves it to a lower tier (``kv_store``). None: nothing to do.
    on_leave: Callable[[CachedPrefix[KV], str], None] | None = None
    shared_blocks: bool = False  # entries share a common prefix's storage: count each block once
    policy: PinPolicy = field(default_factory=PinPolicy)
    max_entries: int | None = None  # entries at most (llama.cpp: its cache sequences); None: tokens bound only
    to_the_token: bool = False  # entries keep a partial last block, and hits reach into it (module docstring)
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[int, CachedPrefix[KV]] = field(default_factory=OrderedDict)  # LRU order, by id
    _index: dict[int, CachedPrefix[KV]] = field(default_factory=dict)  # block hash -> the freshest entry holding it
    _holders: dict[int, dict[int, CachedPrefix[KV]]] = field(default_factory=dict)  # block hash -> every entry holding it
    _pinned: dict[str, CachedPrefix[KV]] = field(default_factory=dict)  # pin key -> the entry it holds
    _next_use: dict[str, float] = field(default_factory=dict)  # program -> when it is predicted back (clock)
    used_tokens: int = 0
    pinned_tokens: int = 0  # tokens of pinned entries, each counted whole
    pinned_entries: int = 0

    def match(self, tokens: Sequence[int], max_tokens: int,
              partition: str = "") -> tuple[CachedPrefix[KV], int] | None:
        """The longest cached prefix of ``tokens`` of at most ``max_tokens`` tokens, in ``partition``: block-aligned,
        or to the token with ``to_the_token``.

        Counts nothing, so a scheduler may ask before it decides (``use`` counts a use).
        """
        self._expire(self.clock())
        tokens = list(tokens[: max(0, max_tokens)])
        hashes = block_hashes(tokens, self.block, partition)
        for i in range(len(hashes) - 1, -1, -1):
            entry = self._index.get(hashes[i])
            n = (i + 1) * self.block
            # A hash collision is no hit.
            if entry is None or entry.partition != partition or entry.tokens[:n] != tokens[:n]:
                continue
            if not self.to_the_token:
                return entry, n
            # Every entry holding the block (the indexed one among them) may go on further with the prompt: the one
            # that goes furthest.
            holders = [e for e in self._holders[hashes[i]].values()
                       if e.partition == partition and e.tokens[:n] == tokens[:n]]
            return max(((e, n + common_prefix(e.tokens[n:], tokens[n:])) for e in holders), key=lambda hit: hit[1])
        return None

    def use(self, entry: CachedPrefix[KV] | None, looked_up: int, found: int) -> None:
        """Count one lookup of ``looked_up`` prompt tokens that reused ``found``; refresh the entry."""
        self.stats.queries += looked_up
        self.stats.hits += found
        if entry is not None and id(entry) in self._entries:
            self._refresh(entry)

    def insert(self, tokens: Sequence[int], make_kv: Callable[[int], KV], partition: str = "") -> None:
        """Offer a filled context's ``tokens``; its block-aligned prefix (all of it, ``to_the_token``) is kept
        (``make_kv(n)``: its first n tokens) in ``partition``."""
        n = len(tokens) if self.to_the_token else len(tokens) // self.block * self.block
        if len(tokens) < self.block or n > self.capacity_tokens:
            return
        found = self.match(tokens, n, partition)
        if found is not None and found[1] == n:
            self._refresh(found[0])  # already cached whole
            return
        prefix = list(tokens[:n])
        for old in [e for e in self._entries.values()
                    if not e.pins and e.partition == partition and e.tokens == prefix[: len(e.tokens)]]:
            self._evict(old, "superseded")
        if self.max_entries is not None:
            while len(self._entries) >= self.max_entries:
                if not self.evict_one():
                    return  # every slot pinned (the pin rules leave one, unless pins came first): not cached
        entry = CachedPrefix(prefix, make_kv(n), partition=partition)
        self._entries[id(entry)] = entry
        self._refresh(entry)
        self.used_tokens += self._charge(entry, +1)
        while self.used_tokens > self.capacity_tokens and self.evict_one():
            pass

    def _charge(self, entry: CachedPrefix[KV], sign: int) -> int:
        """Record ``entry`` as a holder of its blocks (+1) or not (-1); the tokens it adds to the cache or frees."""
        changed = 0
        for h in self._hashes(entry):
            holders = self._holders.setdefault(h, {})
            if sign > 0:
                holders[id(entry)] = entry
            else:
                holders.pop(id(entry), None)
            changed += (sign > 0 and len(holders) == 1) or not holders  # the block's first holder came, or its last left
            if not holders:
                del self._holders[h]
        # A partial last block (``to_the_token``) is the entry's own.
        return changed * self.block + len(entry.tokens) % self.block if self.shared_blocks else len(entry.tokens)

    def _refresh(self, entry: CachedPrefix[KV]) -> None:
        # The most recently used holder of a shared prefix answers for it, so evicting the least
        # recently used entry never unindexes a prefix that a fresher entry still holds.
        self._entries.move_to_end(id(entry))
        entry.last_used = self.clock()
        for h in self._hashes(entry):
            self._index[h] = entry

    def _hashes(self, entry: CachedPrefix[KV]) -> list[int]:
        return block_hashes(entry.tokens, self.block, entry.partition)

    # ----- pins ----------------------------------------------------------------------------

    def pin(self, tokens: Sequence[int], ttl: float, owner: str | None = None,
            next_use: float | None = None, partition: str = "") -> int:
        """Pin the entry caching the longest prefix of ``tokens`` (in ``partition``) for ``ttl`` seconds; the
        tokens it holds, 0 when none is cached or the budget refuses it.

        ``owner``: a program retaining its context. Its earlier pin goes, the entry becomes its, and
        ``next_use`` (seconds until the program is predicted back; None: unknown) ranks the entry's
        eviction once it is unpinned. Without an owner the pin belongs to the entry (a client's mark).
        """
        now = self.clock()
        if owner is not None:
            self.unpin(owner)
        found = self.match(tokens, len(tokens), partition)
        if found is None or ttl <= 0:
            return 0
        entry = found[0]
        if owner is not None:
            entry.owner = owner
            if next_use is not None:
                self._next_use[owner] = now + next_use
        key = owner if owner is not None else f"entry:{id(entry)}"
        if not entry.pins:
            slots_left = self.max_entries is None or self.pinned_entries + 1 < self.max_entries
            if self.pinned_tokens + len(entry.tokens) > self.policy.pin_tokens or not slots_left:
                self.stats.pins_refused += 1
                return 0
            self.pinned_tokens += len(entry.tokens)
            self.pinned_entries += 1
        entry.pins[key] = max(entry.pins.get(key, 0.0), now + ttl)
        self._pinned[key] = entry
        self.stats.pins += 1
        return len(entry.tokens)

    def unpin(self, owner: str) -> None:
        """``owner``'s program goes on without its retained context (it came back, or finished): its pin
        and its prediction go."""
        self._expire(self.clock())
        self._next_use.pop(owner, None)
        entry = self._pinned.pop(owner, None)
        if entry is not None:
            self._drop_pin(entry, owner)
        for e in self._entries.values():
            if e.owner == owner:
                e.owner = None

    def _drop_pin(self, entry: CachedPrefix[KV], key: str) -> None:
        entry.pins.pop(key, None)
        if not entry.pins:
            self.pinned_tokens -= len(entry.tokens)
            self.pinned_entries -= 1

    def _expire(self, now: float) -> None:
        for key, entry in [(k, e) for k, e in self._pinned.items() if e.pins.get(k, 0.0) <= now]:
            del self._pinned[key]
            self._drop_pin(entry, key)
            self.stats.pins_expired += 1

    # ----- eviction ------------------------------------------------------------------------

    def _needed_in(self, entry: CachedPrefix[KV], now: float) -> float:
        """Seconds until ``entry`` is predicted to be needed (see the module docstring)."""
        back = self._next_use.get(entry.owner) if entry.owner is not None else None
        return max(0.0, back - now) if back is not None else now - entry.last_used

    def evict_one(self) -> bool:
        """Drop the unpinned entry needed furthest ahead (least recently used among equals); False when
        every entry is pinned or there is none."""
        now = self.clock()
        self._expire(now)
        victim, furthest, first = None, -1.0, None
        for entry in self._entries.values():  # least recently used first: a later entry must be strictly further
            if entry.pins:
                continue
            first = first or entry
            needed_in = self._needed_in(entry, now)
            if needed_in > furthest:
                victim, furthest = entry, needed_in
        if victim is None:
            return False
        self._evict(victim, "lru" if victim is first else "next_use")
        return True

    evict_lru = evict_one  # the name the cores called it by before predictions

    def _evict(self, entry: CachedPrefix[KV], reason: str) -> None:
        del self._entries[id(entry)]
        self.used_tokens -= self._charge(entry, -1)
        self.stats.evictions += 1
        setattr(self.stats, f"evicted_{reason}", getattr(self.stats, f"evicted_{reason}") + 1)
        for h in self._hashes(entry):
            if self._index.get(h) is entry:
                # Another entry (a pinned one, say) may still hold the block: it answers for it now.
                rest = self._holders.get(h)
                if rest:
                    self._index[h] = max(rest.values(), key=lambda e: e.last_used)
                else:
                    del self._index[h]
        if entry.owner is not None and not any(e.owner == entry.owner for e in self._entries.values()):
            self._next_use.pop(entry.owner, None)
        self._leave(entry, reason)

    def _leave(self, entry: CachedPrefix[KV], reason: str) -> None:
        try:
            if self.on_leave is not None:
                self.on_leave(entry, reason)
        finally:
            if self.on_evict is not None:
                self.on_evict(entry.kv)

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self._leave(entry, "cleared")
        self._entries.clear()
        self._index.clear()
        self._holders.clear()
        self._pinned.clear()
        self._next_use.clear()
        self.used_tokens = self.pinned_tokens = self.pinned_entries = 0

    def __len__(self) -> int:
        return len(self._entries)


def cache_stats(stats: PrefixCacheStats, cache: PrefixCache[Any] | None, capacity: int,
                policy: PinPolicy | None = None) -> dict[str, int]:
    """An engine's ``prefix_cache_*`` stats keys (what /metrics reads), its cache on or off."""
    return {"prefix_cache_queries": stats.queries, "prefix_cache_hits": stats.hits,
            "prefix_cache_tokens": cache.used_tokens if cache is not None else 0,
            "prefix_cache_capacity": capacity,
            "prefix_cache_pinned_tokens": cache.pinned_tokens if cache is not None else 0,
            "prefix_cache_pin_capacity": policy.pin_tokens if policy is not None else 0,
            **{f"prefix_cache_evictions_{reason}": getattr(stats, f"evicted_{reason}")
               for reason in EVICTION_REASONS},
            "prefix_cache_pins": stats.pins, "prefix_cache_pins_expired": stats.pins_expired,
            "prefix_cache_pins_refused": stats.pins_refused}


EVICTION_REASONS = ("lru", "next_use", "superseded")

