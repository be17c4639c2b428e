"""The llama.cpp core's context and its sequences: opening and closing the llama context, a KV context's
sequence, copying a sequence (a fork, a prefix-cache hit, a cache entry), freeing one, and the prefix cache whose
entries hold sequences of their own.

Sequence ids: ``[0, max_contexts)`` hold KV contexts, the next ``SCORE_SEQUENCES`` scoring jobs' scratch
(``batch.ScoringQueue``), the last ``cache_sequences`` the prefix cache's entries. ``LlamaCppCore``
(``engine``) sets the state below in its ``__init__`` and runs the iterations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from headrace.plugins.engines.kvreuse.prefix_cache import BLOCK, PinPolicy, PrefixCache, PrefixCacheStats
from headrace.plugins.engines.llama_cpp.batch import Fill, ScoringQueue
from headrace.plugins.engines.llama_cpp.files import kv_rows, llama, log, sequence_state, set_sequence_state
from headrace.plugins.engines.llama_cpp.lazy_kv import (StreamLayout, anonymous_mappings, kv_buffer_sizes,
                                                        release_kv_buffers, release_ranges, stream_layout)
from headrace.plugins.engines.llama_cpp.options import SCORE_SEQUENCES, WINDOW_CACHE_ENTRIES
from headrace.plugins.engines.llama_cpp.placement import DocumentPlacer
from headrace.plugins.engines.llama_cpp.swa import full_window, window_holds
from headrace.plugins.engines.llama_cpp.tiers import SequenceTiers, open_tiers
from headrace.plugins.protocols import EngineEnv
from headrace.types import ContextId, TokenIds


@dataclass
class ContextSequence:
    """A KV context: one sequence id of the llama context."""

    seq: int
    length: int  # tokens in its KV
    next_logits: np.ndarray | None = None  # (V,) after its prefill, until a decode samples from them
    filling: bool = True  # its prefill has not finished
    decoding: bool = False
    tokens: TokenIds = field(default_factory=list)  # its prompt (a fork: the parent's, then its own)
    partition: str = ""  # its prefill's cache partition: what it is cached under (``Prefill.partition``)


class LlamaSequences:
    """``LlamaCppCore``'s llama context and sequences (a mixin before ``LLMCore``, whose prefix-cache switch
    ``set_prefix_caching`` overrides)."""

    name: str
    max_contexts: int
    max_batch_tokens: int
    prefix_cache_tokens: int
    prefix_cache: PrefixCache[int] | None
    model_file: Path | None
    window: int
    swa_full: bool
    _env: EngineEnv
    _n_ctx: int
    _n_sequences: int
    _kv_unified: bool
    _threads: int
    _swa_option: bool | None
    _cache_sequences: int
    _pins: PinPolicy
    _tier_budgets: tuple[int, int]
    _tiers: SequenceTiers | None
    _cache_stats: PrefixCacheStats
    _model: Any
    _ctx: Any
    _mem: Any
    _vocab: Any
    _batch: Any
    _free_seqs: list[int]
    _free_cache_seqs: list[int]
    # A cache entry whose copy is deferred: its cells still lie in the context it was offered from (``_cache_copy``).
    _deferred_copies: dict[int, tuple[int, int]]
    _contexts: dict[ContextId, ContextSequence]
    _prefills: deque[Fill]
    _scoring: ScoringQueue
    _place: tuple[bool, int]  # place_documents, place_recompute_tokens
    _placer: DocumentPlacer | None
    kv_buffer_bytes: int  # the KV buffers llama.cpp made for the context, all its cells
    kv_released: list[tuple[int, int]]  # their pages handed back to the kernel once made (lazy_kv): address ranges
    # A stream per sequence: each stream's pages handed back when its sequence is emptied (None: not known where)
    _streams: StreamLayout | None = None
    # Emptied streams waiting for the next decode: llama.cpp copies a stream at the next decode, from what the
    # source holds then, so a source's pages may go only once no copy is pending.
    _streams_to_release: set[int]
    _stream_copies_pending = False

    def _open_context(self) -> None:
        lc = llama()
        params = lc.llama_context_default_params()
        params.n_ctx = self._n_ctx
        # Unified: one ubatch per decode. A stream per sequence splits a batch by sequence runs (_undo).
        params.n_batch = params.n_ubatch = self.max_batch_tokens
        params.n_seq_max = self._n_sequences
        params.kv_unified = self._kv_unified
        params.swa_full = self.swa_full = full_window(self._swa_option, self.window, self.prefix_cache_tokens > 0,
                                                      self.name)
        params.n_threads = params.n_threads_batch = self._threads
        params.no_perf = True
        before, sizes = anonymous_mappings(), []
        with kv_buffer_sizes(sizes):
            ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            raise RuntimeError(f"engine {self.name}: llama.cpp could not create a context of {self._n_ctx} tokens")
        # The cells take memory as sequences fill them, not all at once (lazy_kv).
        self.kv_buffer_bytes = int(sum(sizes) * (1 << 20))
        buffers = release_kv_buffers(before, sizes, self.name)
        self.kv_released = [b.released for b in buffers]
        self._streams, self._streams_to_release = None, set()
        if not self._kv_unified and not self.window and len(buffers) == 1 and len(sizes) == 1:
            self._streams = stream_layout(buffers[0], lc.llama_model_n_layer(self._model), *kv_rows(self._model),
                                          lc.llama_n_ctx_seq(ctx), self._n_sequences)
            if self._streams is None:
                log.info("engine %s: the KV buffer's layout is not the one expected; a freed stream's memory stays "
                         "resident", self.name)
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self._batch = lc.llama_batch_init(self.max_batch_tokens, 0, 1)
        self._free_seqs = list(range(self.max_contexts - 1, -1, -1))  # a stack: low ids first
        self._scoring.free = list(range(self.max_contexts + SCORE_SEQUENCES - 1, self.max_contexts - 1, -1))
        first_cache = self.max_contexts + SCORE_SEQUENCES
        self._free_cache_seqs = list(range(first_cache + self._cache_sequences - 1, first_cache - 1, -1))
        if self.prefix_cache_tokens > 0:
            self._tiers = open_tiers(self.model_file, 1 if self._kv_unified else self._n_sequences, BLOCK,
                                     self._env.data_dir / "kv" / self.name, *self._tier_budgets, ctx, self._mem,
                                     self.name)
            if self._tiers is not None:
                self._tiers.usable = self._window_holds
                self._tiers.before_save = self._copy_deferred
            self.set_prefix_caching(True)
        if self._place[0]:
            self._placer = DocumentPlacer(self._model, self._threads, self.max_batch_tokens,
                                          2 * lc.llama_n_ctx_seq(ctx), name=self.name,
                                          recompute_first=self._place[1], block=BLOCK,
                                          store=self._tiers.store if self._tiers is not None else None)
            if self.window:
                self._placer.cannot_place = (f"sliding-window attention ({self.window} tokens): a shifted document "
                                             "would keep its window from the wrong positions")

    def _close(self) -> None:
        """Free every llama.cpp object, on the worker thread, once nothing runs any more."""
        lc = llama()
        if self._placer is not None:
            self._placer.close()
            self._placer = None
        if self._tiers is not None:
            self._tiers.close(self.prefix_cache)
            self._tiers = None
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            lc.llama_free(self._ctx)
            self._ctx = self._mem = None
        if self._model is not None:
            lc.llama_model_free(self._model)
            self._model = self._vocab = None

    def _window_holds(self, seq: int, n: int) -> bool:
        return window_holds(self._mem, seq, n, self.window)

    def _copy_sequence(self, src: int, dst: int, n: int | None = None) -> None:
        """``dst`` holds ``src``'s positions [0, n) (all of them without ``n``); ``dst`` is empty.

        Unified: ``dst`` tags ``src``'s cells. Across streams, ``src``'s cells only, through llama.cpp's state of
        one sequence (``llama_state_seq_get/set_data``): its own ``seq_cp`` copies whole streams (a partial one
        aborts the process), every cell of a 2,048-cell stream (47 MB for SmolLM2-135M) however few the prefix
        holds, so a 16-token prefix-cache hit cost more than its prefill (pages faulted in after ``lazy_kv``
        gave them back) and every cache entry held a whole stream. The copy is trimmed to the prefix at once
        (seq_rm is bookkeeping only: the cells past it stay written)."""
        if src in self._deferred_copies:  # a cache entry whose copy is deferred: read from the context holding it
            src, held = self._deferred_copies[src]
            n = held if n is None else min(n, held)
        lc = llama()
        if self._kv_unified:
            lc.llama_memory_seq_cp(self._mem, src, dst, 0 if n is not None else -1, -1 if n is None else n)
            return
        # A window model's state holds only the window behind the sequence's end: a prefix shorter than the
        # source would lose what its own continuation attends. Its whole stream is copied.
        if self.window or not self._copy_cells(src, dst):
            lc.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # the whole stream, on the next decode
            self._stream_copies_pending = True
        if n is not None:
            lc.llama_memory_seq_rm(self._mem, dst, n, -1)

    def _copy_cells(self, src: int, dst: int) -> bool:
        """``src``'s cells into the empty ``dst``'s stream through the state of one sequence; False: not copied
        (``dst`` still empty), the caller copies the stream."""
        state = sequence_state(self._ctx, src)
        if state is None:
            return False
        if set_sequence_state(self._ctx, dst, state) == len(state):
            return True
        log.warning("engine %s: llama.cpp refused a sequence's own state (%d bytes); copying its whole stream",
                    self.name, len(state))
        llama().llama_memory_seq_rm(self._mem, dst, -1, -1)
        return False

    def _take_sequence(self) -> int:
        """A free sequence id for a new context, chosen to keep the batch's sequences in as few runs of consecutive
        ids as it can: with a stream per sequence llama.cpp runs a batch as one ubatch per such run, and each
        ubatch reads every weight again (16 decoding rows on every other id took 4.3x a step on 16 consecutive
        ids, Xeon). The id that joins two runs of the sequences filling or decoding, else one that extends a run,
        else the lowest."""
        busy = {c.seq for c in self._contexts.values() if c.filling or c.decoding}
        seq = max(self._free_seqs, key=lambda s: ((s - 1 in busy) + (s + 1 in busy), -s))
        self._free_seqs.remove(seq)
        return seq

    def release(self, ctx: ContextId) -> None:
        seq = self._contexts.pop(ctx, None)
        if seq is None:
            return
        self._prefills = deque(f for f in self._prefills if f.seq != seq.seq)
        for entry_seq in [c for c, (src, _) in self._deferred_copies.items() if src == seq.seq]:
            self._copy_deferred(entry_seq)  # the entry's cells go with the context: copied first
        self._drop_sequence(seq.seq, self._free_seqs)

    def _drop_sequence(self, seq: int, pool: list[int]) -> None:
        self._clear_sequence(seq)
        pool.append(seq)

    def _clear_sequence(self, seq: int) -> None:
        llama().llama_memory_seq_rm(self._mem, seq, -1, -1)  # removing a whole sequence never fails
        if self._streams is not None:
            self._streams_to_release.add(seq)
            if not self._stream_copies_pending:
                self._release_streams()

    def _after_decode(self) -> None:
        """A decode ran: the stream copies queued before it are done."""
        self._stream_copies_pending = False
        if self._streams_to_release:
            self._release_streams()

    def _release_streams(self) -> None:
        """The emptied streams' pages back to the kernel (lazy_kv), those still empty: the cells an idle or a
        finished sequence held stop counting, and a whole-stream copy's pages go with its sequence."""
        lc = llama()
        for seq in self._streams_to_release:
            if lc.llama_memory_seq_pos_max(self._mem, seq) < 0:
                release_ranges(self._streams.ranges(seq))
        self._streams_to_release.clear()

    def _offer_to_cache(self, seq: ContextSequence, tokens: TokenIds) -> None:
        """Offer the prefix cache ``tokens``, what ``seq``'s cells hold; a copy of them if it keeps them."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(tokens, lambda n: self._cache_copy(seq.seq, n), seq.partition)

    def _cache_copy(self, src: int, n: int) -> int:
        """A cache sequence holding positions [0, n) of the context sequence ``src`` (the cache keeps at most one
        entry a sequence).

        With a stream per sequence the copy is deferred until something reads the entry (a hit, the tiers) or
        ``src`` is released, so it never delays the context's first token, and it is never made at all when the
        entry goes first: a prompt's entry is superseded when its answer's is offered (prompt and answer), so a
        request that nobody reused meanwhile is copied once, not twice. ``src`` holds [0, n) unchanged meanwhile:
        a context only appends to its cells. A window model's copy is its whole stream, made at once."""
        dst = self._free_cache_seqs.pop()
        if self._kv_unified or self.window:
            self._copy_sequence(src, dst, n)
        else:
            self._deferred_copies[dst] = (src, n)
        return dst

    def _copy_deferred(self, seq: int) -> None:
        """Make cache sequence ``seq``'s deferred copy (``_cache_copy``), if it has one."""
        deferred = self._deferred_copies.pop(seq, None)
        if deferred is not None:
            self._copy_sequence(deferred[0], seq, deferred[1])

    def _evicted(self, seq: int) -> None:
        """A cache entry left: its sequence is free again (an entry whose copy was deferred was never copied)."""
        self._deferred_copies.pop(seq, None)
        self._drop_sequence(seq, self._free_cache_seqs)

    def prefix_caching_enabled(self) -> bool:
        return self.prefix_cache is not None

    def set_prefix_caching(self, enabled: bool) -> None:
        if self.prefix_cache_tokens <= 0:
            super().set_prefix_caching(enabled)  # configured without one: refuse
        if not enabled and self.prefix_cache is not None:
            # A reset (for comparisons), not an eviction: nothing goes to the tiers, which are emptied too.
            self.prefix_cache.on_leave = None
            self.prefix_cache.clear()  # gives every cache sequence back
            self.prefix_cache = None
            if self._tiers is not None:
                self._tiers.store.clear()
        elif enabled and self.prefix_cache is None:
            # A cache sequence is seq_cp'd from its context, which was forked from the cached prefix it
            # extends: in the unified KV they share those cells, so a shared block counts once; with a
            # stream per sequence each entry holds a copy of its own.
            self.prefix_cache = PrefixCache(self.prefix_cache_tokens, stats=self._cache_stats,
                                            shared_blocks=self._kv_unified, policy=self._pins,
                                            max_entries=min(self._cache_sequences, WINDOW_CACHE_ENTRIES)
                                            if self.window else self._cache_sequences, to_the_token=True,
                                            on_leave=self._tiers.offload if self._tiers is not None else None,
                                            on_evict=self._evicted)
