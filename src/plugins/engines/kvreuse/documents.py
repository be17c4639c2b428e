"""Retrieved documents' KV, computed once and kept in an engine's KV tiers, for placement at any position of a
prompt (issue 49, part 2): what every engine that places documents shares (``PlacesDocuments``).

A document's KV is computed alone, from position 0, and kept under its whole blocks of tokens in the tiers'
partition ``DOCUMENTS`` + the request's cache partition, apart from prompts' prefixes. A context a placement
composed is cached under ``PLACED`` + its partition: its KV is close to a full prefill's, not equal, so an exact
prompt never reuses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from headrace.plugins.engines.kvreuse.kv_store import KVStore

log = logging.getLogger(__name__)

DOCUMENTS = "documents\0"
PLACED = "placed\0"
NO_TIERS = "it keeps no KV tiers (prefix cache off, or kv_host_mib and kv_disk_mib 0)"


def place_options(opts: dict[str, Any], key: str, default: bool) -> tuple[bool, int]:
    """An engine's ``place_documents`` (false: documents prefilled like any token;
    ``default`` where unset: the engine's measured choice) and ``place_recompute_tokens``
    (16: each placed document's first tokens computed again in place, EPIC's repair), popped from ``opts``."""
    place = opts.pop("place_documents", default)
    if not isinstance(place, bool):
        raise ValueError(f"{key}.place_documents: must be true or false, not {place!r}")
    first = opts.pop("place_recompute_tokens", 16)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{key}.place_recompute_tokens: must be an integer >= 0, not {first!r}")
    return place, first


def kept_tokens(document: Sequence[int], block: int) -> list[int]:
    """The tokens a document's KV is kept under: its whole blocks (the rest is prefilled in place)."""
    return list(document[:len(document) // block * block])


@dataclass(frozen=True)
class HeldDocument:
    """A document of a prompt whose KV the tiers hold: where it stands, how many of its tokens they hold, the
    payload (the engine's own format)."""

    position: int
    length: int
    payload: bytearray
    stored: int  # the tokens the payload holds (an entry may hold a longer document that begins with this one)


@dataclass
class PlacementStats:
    """What an engine's placements did (``engine.stats()``: each as ``placement_<name>``)."""

    placements: int = 0  # prompts composed with at least one document placed
    placed_tokens: int = 0  # document tokens restored rather than computed
    recomputed_tokens: int = 0  # tokens computed while composing (the head, repairs, between documents)
    fallbacks: int = 0  # prompts with documents prefilled whole: none held, or a restore refused
    documents_prepared: int = 0
    seconds: float = 0.0  # composing (and, on llama.cpp, handing over)

    def as_stats(self) -> dict[str, float]:
        return {f"placement_{k}": v for k, v in vars(self).items()}


@dataclass(kw_only=True)
class DocumentPlacement:
    """What an engine's placer shares: whether it can place (said once in the log when it cannot), and ``prepare``.
    An engine's placer says what stops it (``_refusal``), computes and keeps one document (``_keep``) and
    composes prompts."""

    name: str
    recompute_first: int
    block: int
    store: KVStore | None  # the engine's tiers; None: nothing kept, nothing placed
    cannot_place: str | None = None  # why this engine's documents are prefilled instead
    stats: PlacementStats = field(default_factory=PlacementStats)
    _said: bool = False

    def _refusal(self) -> str | None:
        """Why this model's documents cannot be placed (None: they can); asked while nothing has refused yet."""
        return None

    def _fits(self, tokens: list[int]) -> bool:
        return True

    def _keep(self, tokens: list[int], partition: str) -> None:
        """Compute ``tokens``' KV alone, from position 0, and put it in ``store`` under ``partition``."""
        raise NotImplementedError

    def usable(self) -> bool:
        """Whether documents can be placed; says once in the log why not."""
        if self.cannot_place is None:
            self.cannot_place = NO_TIERS if self.store is None else self._refusal()
        if self.cannot_place is not None and not self._said:
            self._said = True
            log.warning("engine %s: documents are prefilled, not placed: %s", self.name, self.cannot_place)
        return self.cannot_place is None

    def prepare(self, documents: Sequence[Sequence[int]], partition: str) -> int:
        """Compute and keep each document's KV, alone from position 0; how many are held now."""
        if not documents or not self.usable():
            return 0
        assert self.store is not None
        key, held = DOCUMENTS + partition, 0
        for doc in documents:
            tokens = kept_tokens(doc, self.block)
            if not tokens:
                continue
            if not self.store.holds(tokens, key) and self._fits(tokens):
                self._keep(tokens, key)
                self.stats.documents_prepared += 1
            held += self.store.holds(tokens, key)
        return held


def held_documents(store: KVStore, tokens: Sequence[int], documents: Sequence[tuple[int, int]], partition: str,
                   block: int) -> list[HeldDocument]:
    """The leading run of ``documents`` (spans of ``tokens``) whose KV ``store`` holds in ``partition``; the first
    one it lacks (or that would reach the prompt's last token, whose logits a prefill must compute) ends the
    run: it and those after it are prefilled."""
    held = []
    for position, length in documents:
        doc = kept_tokens(tokens[position:position + length], block)
        hit = store.match(doc, len(doc), DOCUMENTS + partition) if doc else None
        if hit is None or hit.tokens != len(doc) or position + len(doc) >= len(tokens):
            break
        payload = store.payload(hit)
        if payload is None:
            break
        held.append(HeldDocument(position, len(doc), payload, len(hit.entry.tokens)))
    return held
