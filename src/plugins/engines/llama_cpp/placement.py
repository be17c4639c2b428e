"""Retrieved documents placed at any position of a prompt on llama.cpp (issue 49, part 2).

A document's KV is computed once, alone from position 0 (``prepare``: at ingest), and kept in the engine's KV
tiers (host memory, disk) as ``kvreuse.documents`` says. A prefill that marks documents (``Prefill.documents``)
is then composed in a small unified llama context of its own (``kv_blend.build``: every document restored, shifted
to where it stands and gathered; then each document's first ``recompute_first`` tokens and the text between the
documents prefilled in place, EPIC's repair, the head first and the other repairs side by side), and the composed
sequence is handed to the engine's main context as a state restore (``saved_for``), where the prompt's rest is
prefilled as usual.

Why a context of its own: joining several documents in one sequence needs a unified KV (``seq_cp`` tags cells;
with a stream per sequence it copies whole streams, and a restore clears its target), while the engine's main
context keeps a stream per sequence for decode speed (``engine``). Work that cannot place prefills instead: a
document the tiers do not hold (or hold damaged: llama.cpp refuses the bytes), or a model whose KV cannot be
shifted (sliding-window or M-RoPE attention: said once in the log).

While it computes, the placement context holds nothing but the prompt's own cells: in a unified KV another
sequence's cells changed a prompt's logits (docs/benchmarks.md, "Documents placed"). Each document passes through
the ``restore`` sequence only to be shifted and tagged, before anything is computed.

The composed KV is close to a full prefill, not equal (docs/benchmarks.md, "Documents placed"), so the context it
leaves in the prefix cache is kept under ``documents.PLACED`` + its partition: an exact prompt never reuses it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from headrace.plugins.engines.kvreuse.documents import DocumentPlacement, held_documents
from headrace.plugins.engines.llama_cpp import kv_blend
from headrace.plugins.engines.llama_cpp.files import llama, sequence_state, set_sequence_state
from headrace.plugins.engines.llama_cpp.lazy_kv import anonymous_mappings, kv_buffer_sizes, release_kv_buffers

log = logging.getLogger("headrace.plugins.engines.llama_cpp")

# The placement context's sequences (kv_blend.build): the composed prompt, the placed documents, one document
# being shifted, and the helpers in which the repairs between documents are computed side by side.
SEQUENCES = kv_blend.BuildSequences(target=0, bodies=1, restore=2, helpers=tuple(range(3, 16)))


def saved_for(ctx: Any, seq: int, streams: int) -> bytearray:
    """Sequence ``seq`` of a one-stream context (the placement context) saved as a context of ``streams`` streams
    reads it: a sequence's state lists every stream of its context, the others empty, and
    llama.cpp restores the cells it finds into the target sequence's own stream whichever entry holds them.
    Written once, in place: a composed prompt's state is ~23 KiB a token."""
    out = sequence_state(ctx, seq, spare=4 * (streams - 1))  # zeroed: the other streams' empty cell counts
    if out is None:
        raise RuntimeError(f"llama.cpp saved the state of sequence {seq} short")
    # After llama.cpp's 8-byte header (a magic number, the saved sequence's id): the stream count, then each
    # stream's cell count and cells.
    if int.from_bytes(out[8:12], "little") != 1:
        raise ValueError("not a one-stream sequence state")
    out[8:12] = streams.to_bytes(4, "little")
    return out


@dataclass
class Composed:
    """What a placement left in the target sequence: positions [0, length), ``placed`` of them restored."""

    length: int
    placed: int


@dataclass
class DocumentPlacer(DocumentPlacement):
    model: Any
    threads: int
    n_batch: int
    n_ctx: int  # the placement context's cells: a prompt and the document being placed
    _ctx: Any = None
    _batch: Any = None

    def _refusal(self) -> str | None:
        """Makes the unified placement context on first use (cells take memory once written: lazy_kv)."""
        if self._ctx is not None:
            return None
        lc = llama()
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = self.n_ctx, 3 + len(SEQUENCES.helpers), True
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        before, sizes = anonymous_mappings(), []
        with kv_buffer_sizes(sizes):
            ctx = lc.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"engine {self.name}: llama.cpp could not create a placement context")
        release_kv_buffers(before, sizes, self.name)
        if not lc.llama_memory_can_shift(lc.llama_get_memory(ctx)):
            lc.llama_free(ctx)
            return "its KV cannot be shifted to a new position (M-RoPE or another layout)"
        self._ctx, self._batch = ctx, lc.llama_batch_init(self.n_batch, 0, 1)
        return None

    def close(self) -> None:
        lc = llama()
        if self._batch is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            lc.llama_free(self._ctx)
            self._ctx = None

    def _fits(self, tokens: list[int]) -> bool:
        return len(tokens) <= self.n_ctx // 2  # longer than a context: never placed whole

    def _keep(self, tokens: list[int], partition: str) -> None:
        assert self.store is not None
        cached = kv_blend.compute_doc(self._ctx, self._batch, SEQUENCES.restore, tokens, self.n_batch)  # emptied
        self.store.put(tokens, cached.state, partition)

    def compose(self, tokens: Sequence[int], documents: Sequence[tuple[int, int]], partition: str, main_ctx: Any,
                main_streams: int, seq: int) -> Composed | None:
        """Fill the empty ``seq`` of ``main_ctx`` (of ``main_streams`` KV streams) with ``tokens``' prefix through
        the last of the leading run of documents the tiers hold, placed; None (``seq`` still empty) when none is
        held or a restore is refused: the caller prefills."""
        if not documents or not self.usable():
            return None
        assert self.store is not None
        start = time.perf_counter()
        found = [(kv_blend.CachedDoc(d.payload, d.length, 0), d.position)
                 for d in held_documents(self.store, tokens, documents, partition, self.block)]
        if not found:
            self.stats.fallbacks += 1
            return None
        end = found[-1][1] + found[-1][0].length
        lc = llama()
        mem = lc.llama_get_memory(self._ctx)
        try:
            prefilled = kv_blend.build(self._ctx, self._batch, SEQUENCES, tokens[:end], found, self.n_batch,
                                       self.recompute_first)
            state = saved_for(self._ctx, SEQUENCES.target, main_streams)
        except (RuntimeError, ValueError) as exc:  # a document's bytes refused (damaged, or another layout)
            log.warning("engine %s: a document's stored KV could not be placed (%s); prefilling the prompt",
                        self.name, exc)
            self.stats.fallbacks += 1
            return None
        finally:
            lc.llama_memory_seq_rm(mem, SEQUENCES.target, -1, -1)  # build empties the others
        if set_sequence_state(main_ctx, seq, state) == 0:
            lc.llama_memory_seq_rm(lc.llama_get_memory(main_ctx), seq, -1, -1)
            log.warning("engine %s: the main context refused a composed prompt's KV; prefilling it", self.name)
            self.stats.fallbacks += 1
            return None
        self.stats.placements += 1
        self.stats.placed_tokens += end - prefilled
        self.stats.recomputed_tokens += prefilled
        self.stats.seconds += time.perf_counter() - start
        return Composed(end, end - prefilled)
