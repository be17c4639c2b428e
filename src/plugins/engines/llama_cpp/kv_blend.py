"""Documents' KV reused at any position on llama.cpp: a document's cells, computed once alone, placed where it
stands in a new prompt by a position shift (llama.cpp re-rotates the cached K with RoPE at its next update),
with the first ``recompute_first`` tokens of each document prefilled again in place (EPIC's rule: it removes
the attention sink a document computed alone has at its start). ``scripts/bench/kv_any_position.py``
measured the rule's quality against a full prefill (docs/benchmarks.md, "Documents at any position"):
on SmolLM2-135M no share held the issue's bar (identical greedy answers on 95% of queries: even a full prefill
split differently gives 50%), and KL <= 0.05 nats needs about 16 tokens per document computed at position 0,
or 32 after the template's constant prefix. It is a building block, not on by default.

Cost to know: llama.cpp applies a pending shift at the next decode by re-rotating the K of EVERY cell of the
cache (its K-shift graph spans ``n_ctx`` cells and all layers, 30-70 ms at 4-10 k cells on the Xeon), so
``build`` places every document before it computes anything: one pass a prompt.

Engine-facing and independent of the daemon: the caller owns the llama.cpp context. ``plan`` orders the work
(prefill steps and placements in position order); ``place`` runs one placement, ``build`` a whole prompt.
llama.cpp takes a sequence's new tokens only at its next position (a batch for sequence s starts at
``seq_pos_max(s) + 1``), so ``build`` computes each prefill step in a helper sequence that holds what stands
before it, and tags the result into the prompt's sequence.

Placement needs a unified KV (``kv_unified = true``): there ``seq_cp`` tags cells, so a document restored into
a scratch sequence, shifted there, and tagged into the target is one copy of its bytes. With a stream per
sequence llama.cpp copies only whole streams (``seq_cp`` resets the destination) and a state restore clears
its destination sequence first, so several documents cannot be joined in one sequence through the API.
A cached document's state must not be shifted in a sequence that still shares its cells (a cell has one
position), hence the restore from saved bytes into scratch rather than a ``seq_cp`` of a cached sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from headrace.plugins.engines.llama_cpp.files import llama, sequence_state, set_sequence_state

# The first tokens of each document prefilled again in place (documents computed at position 0: mean KL 0.046
# nats against a full prefill in docs/benchmarks.md; 0 tokens: 0.127).
DEFAULT_RECOMPUTE_FIRST = 16


@dataclass(frozen=True)
class CachedDoc:
    """A document's KV computed alone: the sequence state llama.cpp saved, the document's token count, and the
    position its first token had when computed (0 alone, or the length of the exact prefix it followed)."""

    state: bytearray
    length: int
    base: int


@dataclass(frozen=True)
class Step:
    """Positions [start, end) of the target: ``prefill`` them (the caller's tokens there), or ``place`` the
    cached cells of document ``doc`` (an index into the placements) that fall there."""

    kind: Literal["prefill", "place"]
    start: int
    end: int
    doc: int = -1


def plan(n_tokens: int, docs: Sequence[tuple[int, int]], recompute_first: int = DEFAULT_RECOMPUTE_FIRST) -> list[Step]:
    """The steps that build a prompt of ``n_tokens`` whose documents stand at ``docs`` ((target position,
    length) each, in position order, not overlapping): everything outside the documents and each document's
    first ``recompute_first`` tokens is prefilled, the rest placed. The last prompt token is always prefilled
    (the caller needs its logits)."""
    steps: list[Step] = []
    pos = 0

    def prefill(end: int) -> None:
        nonlocal pos
        if end > pos:
            if steps and steps[-1].kind == "prefill":
                steps[-1] = Step("prefill", steps[-1].start, end)
            else:
                steps.append(Step("prefill", pos, end))
            pos = end

    for i, (start, length) in enumerate(docs):
        if start < pos or length < 0:
            raise ValueError(f"document {i} at {start} overlaps what comes before it (up to {pos})")
        end = min(start + length, n_tokens - 1)
        prefill(min(start + recompute_first, end))
        if end > pos:
            steps.append(Step("place", pos, end, i))
            pos = end
    prefill(n_tokens)
    return steps


def prefill(ctx: Any, batch: Any, seq: int, tokens: Sequence[int], start: int, n_batch: int,
            logits_last: bool = False) -> None:
    """Decode ``tokens`` into ``seq`` from position ``start``, ``n_batch`` at a time (``batch`` from
    ``llama_batch_init`` for at least that many); logits for the last one if asked (then the only output
    row: ``llama_get_logits_ith(ctx, -1)``)."""
    decode_side_by_side(ctx, batch, [(seq, tokens, start)], n_batch, logits_of=0 if logits_last else -1)


def save_state(ctx: Any, seq: int) -> bytearray:
    state = sequence_state(ctx, seq)
    if state is None:
        raise RuntimeError(f"llama.cpp saved the state of sequence {seq} short")
    return state


def compute_doc(ctx: Any, batch: Any, seq: int, tokens: Sequence[int], n_batch: int,
                prefix: Sequence[int] = (), start: int = 0) -> CachedDoc:
    """A document's KV computed alone in the empty sequence ``seq`` from position ``start`` (after ``prefix``,
    dropped from the saved state), saved, and ``seq`` emptied again."""
    lc = llama()
    mem = lc.llama_get_memory(ctx)
    try:
        prefill(ctx, batch, seq, [*prefix, *tokens], start, n_batch)
        lc.llama_memory_seq_rm(mem, seq, start, start + len(prefix))
        return CachedDoc(save_state(ctx, seq), len(tokens), start + len(prefix))
    finally:
        lc.llama_memory_seq_rm(mem, seq, -1, -1)


def place(ctx: Any, target: int, scratch: int, doc: CachedDoc, start: int, step: Step, follows: bool = True) -> None:
    """Put ``doc``'s cells for the positions ``step`` covers into ``target``, the document standing at
    ``start``: restored into the empty ``scratch``, shifted, the rest dropped, tagged into ``target`` (which must
    end just before them unless ``follows`` is false)."""
    lc = llama()
    mem = lc.llama_get_memory(ctx)
    if follows and lc.llama_memory_seq_pos_max(mem, target) != step.start - 1:
        raise ValueError(f"sequence {target} must end at {step.start - 1} before a placement at {step.start}")
    try:
        if set_sequence_state(ctx, scratch, doc.state) == 0:
            raise RuntimeError("llama.cpp could not restore a document's state (no room, or another layout)")
        if start != doc.base:
            lc.llama_memory_seq_add(mem, scratch, doc.base, doc.base + doc.length, start - doc.base)
        lc.llama_memory_seq_cp(mem, scratch, target, step.start, step.end)
    finally:
        lc.llama_memory_seq_rm(mem, scratch, -1, -1)


@dataclass(frozen=True)
class BuildSequences:
    """The sequences of a unified context that ``build`` works in: the prompt's own (``target``, empty), the placed
    documents' cells before they join it (``bodies``), one document's state while it is shifted (``restore``),
    and the sequences in which repairs are computed side by side (``helpers``: at least one)."""

    target: int
    bodies: int
    restore: int
    helpers: tuple[int, ...]


def decode_side_by_side(ctx: Any, batch: Any, parts: Sequence[tuple[int, Sequence[int], int]], n_batch: int,
                        logits_of: int = -1) -> None:
    """Decode each (sequence, tokens, first position) of ``parts`` in the same batches, ``n_batch`` tokens at a
    time; logits only for the last token of part ``logits_of`` (then the only output row)."""
    lc = llama()
    rows = [(seq, tok, start + i, p == logits_of and i == len(toks) - 1)
            for p, (seq, toks, start) in enumerate(parts) for i, tok in enumerate(toks)]
    for s in range(0, len(rows), n_batch):
        part = rows[s:s + n_batch]
        for i, (seq, tok, pos, out) in enumerate(part):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = out
        batch.n_tokens = len(part)
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")


def build(ctx: Any, batch: Any, seqs: BuildSequences, tokens: Sequence[int],
          docs: Sequence[tuple[CachedDoc, int]], n_batch: int,
          recompute_first: int = DEFAULT_RECOMPUTE_FIRST) -> int:
    """The whole prompt ``tokens`` in the empty ``seqs.target``, documents ((cached, target position) each)
    placed, the rest prefilled, the last token's logits computed (``llama_get_logits_ith(ctx, -1)``). Returns
    the number of tokens prefilled.

    Every document is placed before anything is computed, so llama.cpp re-rotates the cache's K once (its
    K-shift pass spans every cell, whatever moved: one per document cost more than the repairs on AMX). The
    prefill steps then run in rounds, each step in a helper sequence that holds everything composed before it:
    the first step alone (the head: every later token attends it), then the rest side by side, as many at once as
    there are helpers. A repair computed side by side does not attend the repairs beside it in its round (each
    document's first tokens and the text between documents): EPIC's repair attends them; the measured cost is in
    docs/benchmarks.md ("Documents placed")."""
    lc = llama()
    mem = lc.llama_get_memory(ctx)
    steps = plan(len(tokens), [(pos, d.length) for d, pos in docs], recompute_first)
    fills = [s for s in steps if s.kind == "prefill"]
    width = len(seqs.helpers)
    rounds = [fills[:1]] + [fills[i:i + width] for i in range(1, len(fills), width)] if fills else []
    try:
        for step in steps:
            if step.kind == "place":
                cached, pos = docs[step.doc]
                place(ctx, seqs.bodies, seqs.restore, cached, pos, step, follows=False)
        for round_ in rounds:
            for helper, step in zip(seqs.helpers, round_):
                lc.llama_memory_seq_cp(mem, seqs.target, helper, 0, step.start)
                lc.llama_memory_seq_cp(mem, seqs.bodies, helper, 0, step.start)
            last = next((i for i, s in enumerate(round_) if s.end == len(tokens)), -1)
            decode_side_by_side(ctx, batch, [(h, tokens[s.start:s.end], s.start) for h, s in zip(seqs.helpers, round_)],
                                n_batch, logits_of=last)
            for helper, step in zip(seqs.helpers, round_):
                lc.llama_memory_seq_cp(mem, helper, seqs.target, step.start, step.end)
                lc.llama_memory_seq_rm(mem, helper, -1, -1)
        lc.llama_memory_seq_cp(mem, seqs.bodies, seqs.target, -1, -1)
    finally:
        for seq in (seqs.bodies, seqs.restore, *seqs.helpers):
            lc.llama_memory_seq_rm(mem, seq, -1, -1)
    return sum(s.end - s.start for s in fills)
