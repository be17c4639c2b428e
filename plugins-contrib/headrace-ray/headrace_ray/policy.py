"""Which replicas a request should go to, in ranks: the routing decision apart from Ray.

1. A request whose run or session lives on a replica goes there (``RouteKey.owner``); if that
   replica is gone, to the least loaded one, which answers that the run went with its replica.
2. When the replicas' loads differ by more than ``imbalance_threshold`` requests, they go by
   load alone (prefix affinity must not pile the traffic of one hot prompt onto one replica).
3. Otherwise the replicas holding the longest prefix of the prompt (at least ``min_match_blocks``
   blocks) come first, then those where the request's engines are resident, then the rest.

Each of these groups is split by load, least first: Ray takes a rank's replica with the
shortest queue by its own cached queue lengths, which lag (an open event stream counts in this
router's load at once); equally loaded replicas share a rank, and Ray breaks the tie.

The prefix index is this router's record of where it sent each prompt block: an LRU map
bounded by ``max_blocks``, from a chained block hash to the replicas it went to.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from headrace_ray.keys import RouteKey


@dataclass(frozen=True)
class PolicyConfig:
    """The router's settings (``request_router_kwargs``)."""

    imbalance_threshold: int = 8  # requests: a larger gap between the busiest and idlest replica routes by load
    min_match_blocks: int = 1  # a shorter shared prefix is no reason to prefer a replica
    max_blocks: int = 200_000  # prefix index entries (block hash -> replicas) kept, least recently used dropped

    def __post_init__(self) -> None:
        for name in ("imbalance_threshold", "min_match_blocks", "max_blocks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < (0 if name != "max_blocks" else 1):
                raise ValueError(f"{name} must be a non-negative integer (max_blocks >= 1), got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ReplicaView:
    """What the policy knows of one live replica."""

    tag: str
    load: int  # requests this router has on it now (or Ray's cached queue length, if larger)
    resident: frozenset[str] = frozenset()  # its engines that are loaded now (its routing stats)


class AffinityPolicy:
    def __init__(self, config: PolicyConfig = PolicyConfig()) -> None:
        self.config = config
        self._index: OrderedDict[str, set[str]] = OrderedDict()

    def rank(self, replicas: Sequence[ReplicaView], key: RouteKey) -> list[list[str]]:
        """The replicas' tags in ranks, most preferred first (never an empty rank)."""
        if not replicas:
            return []
        tags = [r.tag for r in replicas]
        if key.owner is not None:
            if key.owner in tags:
                return [[key.owner]]
            return [[min(replicas, key=lambda r: r.load).tag]]
        load = {r.tag: r.load for r in replicas}
        if max(load.values()) - min(load.values()) > self.config.imbalance_threshold:
            return _by_load(tags, load)
        matched = self.matches(key.prefix_blocks)
        best = max((matched.get(t, 0) for t in tags), default=0)
        first = [t for t in tags if best >= self.config.min_match_blocks and matched.get(t, 0) == best]
        wanted = set(key.engines)
        resident = [r.tag for r in replicas if wanted and wanted <= r.resident and r.tag not in first]
        rest = [t for t in tags if t not in first and t not in resident]
        return [rank for group in (first, resident, rest) for rank in _by_load(group, load)]

    def matches(self, blocks: Sequence[str]) -> dict[str, int]:
        """For each replica the index knows, how many leading blocks of ``blocks`` it holds."""
        out: dict[str, int] = {}
        for depth, block in enumerate(blocks, start=1):
            holders = self._index.get(block)
            if not holders:
                break  # chained hashes: no replica holds a deeper block either
            for tag in holders:
                out[tag] = depth
            self._index.move_to_end(block)
        return out

    def routed(self, tag: str, key: RouteKey) -> None:
        """Record that ``key``'s prompt went to ``tag``: its prefix is cached there now."""
        for block in key.prefix_blocks:
            self._index.setdefault(block, set()).add(tag)
            self._index.move_to_end(block)
        while len(self._index) > self.config.max_blocks:
            self._index.popitem(last=False)

    def forget(self, tag: str) -> None:
        """A replica died: its cache went with it."""
        for block in [b for b, holders in self._index.items() if tag in holders]:
            holders = self._index[block]
            holders.discard(tag)
            if not holders:
                del self._index[block]


def _by_load(tags: list[str], load: dict[str, int]) -> list[list[str]]:
    """``tags`` in ranks of equal load, least loaded first (order kept within a rank)."""
    ranks: dict[int, list[str]] = {}
    for tag in tags:
        ranks.setdefault(load[tag], []).append(tag)
    return [ranks[n] for n in sorted(ranks)]
