"""The built-in llama.cpp LLM engine (plugin ``llama-cpp``): a core on the shared LLM front.

One llama.cpp context holds every KV context as a *sequence*. By default each sequence has a KV stream of its
own (``kv_unified = false``, what llama-server runs with ``-np``): attention then reads only the sequence's
own cells, so prompts that prefill, score or decode side by side do not pay for each other's cells, as they do
in one unified cache whose attention (and mask) spans every sequence's cells. A fork or a prefix-cache hit
copies the parent's cells into its own stream (through llama.cpp's state of one sequence, ``sequences``; the copy
is then trimmed to the prefix), in time and memory as the cells it holds. With ``kv_unified = true`` every sequence
may use any of the ``n_ctx`` cells and a fork tags the parent's cells rather than copying them. Each worker
iteration is ONE ``llama_decode`` of what ``batch`` plans. Logits are requested only where a prompt
ends or a row decodes, and sampled by headrace's own sampler, so temperature, top_p and seed mean what they
mean on the torch engine. Preemptive decodes of a lower rank pause, KV kept, for more urgent work
(``_preempt``). The llama context and its sequences are kept by ``sequences``.

The tokenizer and chat template are the model's own, loaded by transformers from the GGUF as the torch engine
loads them, so both engines see the same token ids for the same text.

Faults stay with their request: the front refuses token ids outside the vocabulary before they are queued, and
should a combined ``llama_decode`` fail anyway, its parts are retried one by one (llama.cpp restores the KV
cache after a failed decode), so only a part that fails alone gets an error: the decoding rows together, or
one prefill, or one scoring job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from headrace.plugins.engines.kvreuse.documents import PLACED
from headrace.plugins.engines.kvreuse.prefix_cache import PrefixCache, PrefixCacheStats, cache_stats
from headrace.plugins.engines.llama_cpp.batch import (DecodeFailed, Fill, Part, ScoringQueue, batch_entries,
                                                      common_length, plan, write_batch)
from headrace.plugins.engines.llama_cpp.files import (ProbeModel, float_rows, llama, load_tokenizer,
                                                      model_footprint_bytes, quantized_model)
from headrace.plugins.engines.llama_cpp.options import SCORE_SEQUENCES, parse_options
from headrace.plugins.engines.llama_cpp.placement import Composed
from headrace.plugins.engines.llama_cpp.sequences import ContextSequence, LlamaSequences
from headrace.plugins.engines.llama_cpp.swa import window_of
from headrace.plugins.engines.llama_cpp.tiers import SequenceTiers
from headrace.plugins.engines.llm.core import LLMCore, Row, logprobs_row, prefill_answer, sample_rows_numpy
from headrace.plugins.engines.llm.front import LLMFront
from headrace.plugins.engines.llm.messages import Decode, EngineError, Logits, Outbox, Prefill
from headrace.plugins.engines.llm.preemption import PausedRows, Want
from headrace.plugins.engines.llm.prompt_scores import PromptScorer
from headrace.plugins.hookspecs import hookimpl
from headrace.plugins.protocols import EngineEnv, EngineSpec
from headrace.types import ContextId

log = logging.getLogger("headrace.plugins.engines.llama_cpp")  # one log for the engine, its files and backends


class LlamaCppCore(LlamaSequences, LLMCore):
    pauses_decodes = True
    scores_prompts = True
    keeps_contexts = True
    isolates_caches = True
    scores_through_cache = True
    # One OpenMP pool: loading on another thread (the AMX weight repack runs a team) left a second pool parked, and
    # libgomp then stops its waiters spinning (``retrieval.own_thread``; docs/engines.md, "One OpenMP pool").
    load_on_worker = True

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        o = parse_options(spec)
        self._path, self._env, self._threads, self._kv_unified = o.path, env, o.threads, o.kv_unified
        self.max_contexts, self.max_batch_tokens, self._n_ctx = o.max_contexts, o.max_batch_tokens, o.n_ctx
        self.prefix_cache_tokens, self._cache_sequences, self._pins = o.prefix_cache_tokens, o.cache_sequences, o.pins
        self._context_wait, self._quant, self._n_sequences = o.context_wait, o.quantize, o.sequences
        self._tier_budgets = o.kv_host_bytes, o.kv_disk_bytes
        self._tiers: SequenceTiers | None = None  # host memory and disk below the cached prefixes' cells
        self._swa_option, self.window, self.swa_full = o.swa_full, 0, True  # swa: set by load()
        self._place, self._placer = (o.place_documents, o.place_recompute_tokens), None  # placement
        self.places_documents = o.place_documents
        super().__init__(spec.name, o.max_context_tokens, o.stream_interval)
        self.chat_template = o.chat_template  # the front sets it on the tokenizer once loaded
        self.model_file: Path | None = None  # what llama.cpp loaded (the converted copy)
        self._model: Any = None
        self._ctx: Any = None
        self._mem: Any = None
        self._vocab: Any = None
        self._n_vocab = 0
        self._batch: Any = None
        self._free_seqs: list[int] = []
        self._contexts: dict[ContextId, ContextSequence] = {}
        self._rows: list[Row] = []
        self._waiting: list[Row] = []
        self._paused = PausedRows(o.max_pause)  # rows out of the batch for more urgent work, KV kept
        self._prefills: deque[Fill] = deque()
        # Prefills waiting for a free sequence (all n_seq_max in use), oldest first, with when they came.
        self._blocked: deque[tuple[float, Prefill]] = deque()
        # In a unified KV scoring takes at most half the cells (one prompt always may): contexts need the
        # rest. With a stream per sequence each prompt has its scratch sequence's own.
        self._scoring = ScoringQueue(self._copy_sequence, self._clear_sequence,
                                     self._n_ctx // 2 if self._kv_unified else None)
        # Tokens put through llama_decode since load, by part kind: what a cache or a shared prefix saved.
        self.token_counts = {"decode": 0, "prefill": 0, "score": 0}
        self._cache_stats = PrefixCacheStats()  # counted across switching the cache off and on
        self.prefix_cache: PrefixCache[int] | None = None  # made by load(): entries hold sequence ids
        self._free_cache_seqs: list[int] = []
        self._deferred_copies: dict[int, tuple[int, int]] = {}  # cache sequence -> (context sequence, tokens)

    # ----- lifetime ----------------------------------------------------------------------

    def load(self) -> None:
        lc = llama(ProbeModel(self._path, self._env.cache_dir, self._quant, self._threads))
        limit = lc.llama_max_parallel_sequences()
        if self._n_sequences > limit:
            raise ValueError(f"engines.{self.name}.options.n_seq_max: at most "
                             f"{limit - SCORE_SEQUENCES - self._cache_sequences} "
                             f"(llama.cpp runs {limit} sequences, {SCORE_SEQUENCES} of them for scoring)")
        self.tokenizer = load_tokenizer(self._path, self._env.cache_dir)
        self.model_file = quantized_model(self._path, self._env.cache_dir, self._quant, self._threads)
        params = lc.llama_model_default_params()
        model = lc.llama_model_load_from_file(str(self.model_file).encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {self.model_file}")
        self._model = model
        self._vocab = lc.llama_model_get_vocab(model)
        self._n_vocab = self.vocab_size = lc.llama_vocab_n_tokens(self._vocab)  # the logits' width: the model's
        self.window = window_of(model)
        # The same end-of-turn tokens as the torch engine: the tokenizer's and the GGUF's EOS.
        eos = (self.tokenizer.eos_token_id, lc.llama_vocab_eos(self._vocab))
        self.eos = {t for t in eos if t is not None and t >= 0}
        self.max_context_tokens = min(self.max_context_tokens, lc.llama_model_n_ctx_train(model), self._n_ctx)
        try:
            self._open_context()
            # A sequence's stream (or the unified cache) bounds one context.
            self.max_context_tokens = min(self.max_context_tokens, lc.llama_n_ctx_seq(self._ctx))
        except BaseException:
            self._close()
            raise

    # unload(): serving() already freed every llama.cpp object when the worker stopped, and abandon()
    # dropped the prefix cache; load() opens them again.
    reloadable = True

    def footprint_bytes(self) -> int:
        if self._model is None:
            return 0
        cells = llama().llama_n_ctx(self._ctx) if self._ctx is not None else self._n_ctx  # llama.cpp pads streams
        return model_footprint_bytes(self._model, cells)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The worker thread uses what ``load`` made, and frees it when it stops."""
        try:
            yield
        finally:
            self._close()

    # ----- commands ------------------------------------------------------------------------

    def has_work(self) -> bool:
        # A blocked prefill with a sequence free was deferred behind a shared-prefix fill: once that
        # fill ends it is admissible now, not when its context wait times out.
        blocked_admissible = bool(self._blocked and self._free_seqs)
        return bool(self._rows or self._waiting or self._paused or self._prefills or self._scoring
                    or blocked_admissible)

    def add_prefills(self, jobs: list[Prefill], out: Outbox) -> None:
        now = time.monotonic()
        self._blocked.extend((now, job) for job in jobs)
        self._admit_blocked(out)

    def _admit_blocked(self, out: Outbox) -> None:
        """Start waiting prefills, oldest first, while sequences are free. Under load every sequence
        may be held (contexts a run keeps between its prefill and its decode): a prefill then waits
        for one to be freed, as a request waits for KV blocks in vLLM, rather than failing; after
        ``context_wait_seconds`` it fails with a clear error."""
        if not self._blocked:  # every step calls this: nothing to sort or admit
            return
        now = time.monotonic()
        # The most urgent first (lowest priority; stable, so oldest first among equals).
        self._blocked = deque(sorted(self._blocked, key=lambda e: e[1].priority))
        deferred: list[tuple[float, Prefill]] = []
        try:
            self._admit_in_order(now, deferred, out)
        finally:
            self._blocked.extendleft(reversed(deferred))

    def _admit_in_order(self, now: float, deferred: list[tuple[float, Prefill]], out: Outbox) -> None:
        while self._blocked:
            since, job = self._blocked[0]
            if job.reply.abandoned:
                self._blocked.popleft()
                continue
            if self._waits_for_shared_prefix(job):
                deferred.append(self._blocked.popleft())  # next step it finds the prefix cached
                continue
            if not self._free_seqs and job.ctx not in self._contexts:
                if now - since < self._context_wait:
                    return
                self._blocked.popleft()
                out.reply(job.reply, error=EngineError(
                    f"engine {self.name!r} holds at most {self.max_contexts} contexts at once "
                    f"(engines.{self.name}.options.n_seq_max), and none was freed within "
                    f"{self._context_wait:g} s (context_wait_seconds)"))
                continue
            self._blocked.popleft()
            try:
                self._add_prefill(job)
            except Exception as exc:
                out.reply(job.reply, error=self.error(exc))

    def _waits_for_shared_prefix(self, job: Prefill) -> bool:
        """A fresh prompt sharing a longer prefix with a prompt being filled than the cache holds for it:
        it waits for that fill to end, so the shared prefix is computed once."""
        cache = self.prefix_cache
        if cache is None or job.parent is not None or job.scoring is not None:
            return False
        # Only a fill of its own partition: waiting on another's would time what that one is filling.
        filling = [self._contexts[f.prefill.ctx].tokens for f in self._prefills
                   if f.prefill is not None and f.prefill.ctx in self._contexts
                   and f.prefill.partition == job.partition]
        if not filling:
            return False
        shared = max(common_length(tokens, job.tokens, len(job.tokens) - 1) for tokens in filling)
        hit = cache.match(job.tokens, len(job.tokens) - 1, job.partition)
        return shared // cache.block * cache.block >= (hit[1] if hit else 0) + 2 * cache.block

    def wake_after(self) -> float | None:
        if not self._blocked:
            return None
        return max(0.0, self._blocked[0][0] + self._context_wait - time.monotonic())

    def _add_prefill(self, job: Prefill) -> None:
        base = 0
        parent = None
        if job.parent is not None:
            parent = self._contexts.get(job.parent)
            if parent is None or parent.filling or parent.decoding:
                raise EngineError(f"parent context {job.parent!r} has no KV to fork from "
                                  "(freed, still filling, or decoding)")
            rebased = self._rebased(job, parent)
            if rebased is not None:
                job, parent = rebased, None
            else:
                base = parent.length
        too_long = self.context_too_long(base + len(job.tokens))
        if too_long is not None:
            raise too_long
        # Checked again here (the front checks first): one bad id would fail the whole llama_decode.
        bad = [t for t in job.tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"prefill failed: token id {bad[0]!r} is not in the vocabulary "
                              f"(0 to {self.vocab_size - 1})")
        if job.ctx in self._contexts:
            raise EngineError(f"context {job.ctx!r} already exists")
        if not self._free_seqs:
            raise EngineError(f"engine {self.name!r} holds at most {self.max_contexts} contexts at once "
                              f"(engines.{self.name}.options.n_seq_max); free some first")
        # A fresh prompt starting with a cached prefix forks it and fills only the rest (a scored one is
        # computed whole: a reused position has no logits).
        fresh = parent is None and job.scoring is None
        hit = None
        if fresh and self.prefix_cache is not None:
            hit = self.prefix_cache.match(job.tokens, len(job.tokens) - 1, job.partition)
            if hit is not None and not self._window_holds(hit[0].kv, hit[1]):
                hit = None  # its window layers lost what the prompt's next tokens attend: a miss (swa)
        seq = self._take_sequence()
        composed = self._placed(job, seq, hit[1] if hit else 0) if fresh and job.documents else None
        skip = 0
        if composed is not None:  # its documents placed (placement): the rest is prefilled below
            hit, skip = None, composed.length
        elif fresh and self._tiers is not None and self.prefix_cache is not None:
            # Or a longer prefix from the tiers below the cells, restored rather than prefilled.
            skip = self._tiers.restore(job.tokens, len(job.tokens) - 1, hit[1] if hit else 0, seq, job.partition)
        if fresh and self.prefix_cache is not None and composed is None:  # hits: the cells' or a tier's
            self.prefix_cache.use(hit[0] if hit and not skip else None, len(job.tokens) - job.rebased,
                                  max(0, (skip or (hit[1] if hit else 0)) - job.rebased))
        if parent is not None:
            self._copy_sequence(parent.seq, seq)
        elif hit is not None and not skip:
            entry, skip = hit
            self._copy_sequence(entry.kv, seq, skip)  # positions [0, skip)
        prompt = (parent.tokens if parent is not None else []) + list(job.tokens)
        # A placed context is cached apart: an exact prompt never reuses its approximate KV.
        partition = job.partition if composed is None else PLACED + job.partition
        self._contexts[job.ctx] = ContextSequence(seq=seq, length=base + skip, tokens=prompt, partition=partition)
        scorer = None
        if job.scoring is not None:
            scorer = PromptScorer(job.tokens, job.scoring, parent.next_logits if parent is not None else None)
        self._prefills.append(Fill(seq=seq, tokens=list(job.tokens[skip:]), start=base + skip, prefill=job,
                                   cached=composed.placed if composed is not None else max(0, skip - job.rebased),
                                   scorer=scorer))

    def _placed(self, job: Prefill, seq: int, in_cells: int) -> Composed | None:
        """``job``'s documents placed in the empty ``seq`` (``placement``), when that covers more of the prompt than
        the exact prefix the cells (``in_cells`` tokens) or the tiers hold; None: ``seq`` still empty."""
        if self._placer is None or job.scoring is not None:
            return None
        exact = in_cells
        if self._tiers is not None and self.prefix_cache is not None:
            stored = self._tiers.store.match(job.tokens, len(job.tokens) - 1, job.partition)
            exact = max(exact, stored.tokens if stored is not None else 0)
        if exact >= job.documents[-1][0]:
            return None  # every document but the last (at most) is an exact prefix already
        try:
            composed = self._placer.compose(job.tokens, job.documents, job.partition, self._ctx,
                                            1 if self._kv_unified else self._n_sequences, seq)
        except Exception:  # a fault of the placement path costs this prompt its reuse, not its answer
            log.exception("engine %s: placing a prompt's documents failed; prefilling it", self.name)
            self._clear_sequence(seq)
            return None
        if composed is not None and composed.length <= exact:
            self._clear_sequence(seq)
            return None
        return composed

    def _rebased(self, job: Prefill, parent: ContextSequence) -> Prefill | None:
        """``job`` as a fresh prompt (its parent's tokens, then its own) when the cells or the tiers hold a prefix
        of that whole at least a block longer than the parent: a chunk prefilled when its collection ingested it
        (issue 49) is then restored after the template's head, not prefilled again on a fork of the head."""
        cache = self.prefix_cache
        if job.scoring is not None or cache is None or len(parent.tokens) != parent.length:
            return None
        whole = [*parent.tokens, *job.tokens]
        if job.documents and self._placer is not None:  # placed whole: the head is short, the documents not
            return replace(job, tokens=whole, parent=None, rebased=parent.length,
                           documents=tuple((start + parent.length, n) for start, n in job.documents))
        hit = cache.match(whole, len(whole) - 1, job.partition)
        longest = hit[1] if hit else 0
        if self._tiers is not None:
            stored = self._tiers.store.match(whole, len(whole) - 1, job.partition)
            longest = max(longest, stored.tokens if stored is not None else 0)
        if longest < parent.length + cache.block:
            return None
        return replace(job, tokens=whole, parent=None, rebased=parent.length)

    def add_scoring(self, job: Logits) -> None:
        self._scoring.add(job)

    def start_decode(self, cmd: Decode, out: Outbox) -> None:
        ctx = self._contexts.get(cmd.ctx)
        if ctx is None or ctx.next_logits is None:
            out.fail_stream(cmd.send, EngineError(f"context {cmd.ctx!r} is not prefilled, or has decoded already"))
            return
        ctx.decoding = True
        self._waiting.append(self.new_row(cmd, ctx.length, ctx.tokens))

    def stop(self, ctx: ContextId, free: bool) -> None:
        self._blocked = deque((t, job) for t, job in self._blocked if job.ctx != ctx)
        self._rows = [r for r in self._rows if r.ctx != ctx]
        self._waiting = [r for r in self._waiting if r.ctx != ctx]
        self._paused.drop(ctx)
        seq = self._contexts.get(ctx)
        if seq is not None:
            seq.decoding = False
            if seq.filling:  # a prefill stopped half way never finishes
                self._prefills = deque(f for f in self._prefills if f.seq != seq.seq)
                free = True
        if free:
            self.release(ctx)

    def row_finished(self, r: Row) -> None:
        seq = self._contexts.get(r.ctx)
        if seq is not None:
            seq.decoding = False
            seq.length = r.length
            # The prompt and its answer are kept, as llama-server's slot keeps its last exchange: a chat's next turn
            # repeats them, and a repeated prompt is then reused to its last token. It costs a copy of the cells.
            # The last token sampled is not in the KV.
            self._offer_to_cache(seq, seq.tokens + r.detok.ids[: r.length - len(seq.tokens)])
        super().row_finished(r)

    def stats(self) -> dict[str, int]:
        # Waiting: decodes not yet in the batch, and prefills waiting for a free sequence.
        stats = {"contexts": len(self._contexts), "decoding": len(self._rows),
                 "waiting": len(self._waiting) + len(self._blocked),
                 "paused": len(self._paused), "preemptions": self._paused.pauses}
        if self.prefix_cache_tokens > 0:
            stats.update(cache_stats(self._cache_stats, self.prefix_cache, self.prefix_cache_tokens, self._pins))
        if self._tiers is not None:
            stats.update(self._tiers.store.stats())
        if self._placer is not None:
            stats.update(self._placer.stats.as_stats())
        # Contexts and cached prefixes share the llama context's n_ctx cells (read on the event loop: list() copies).
        held = sum(seq.length for seq in list(self._contexts.values())) + stats.get("prefix_cache_tokens", 0)
        stats.update(kv_cache_tokens=held, kv_cache_capacity=self._n_ctx)
        return stats

    # ----- one iteration -------------------------------------------------------------------

    def step(self, out: Outbox) -> None:
        self._admit_blocked(out)
        self._preempt()
        self._admit(out)
        parts = self._plan()
        if parts:
            out.hand_over()  # the first tokens _admit sampled go out before this decode, not after it
            self._run(parts, out)

    def _admit(self, out: Outbox) -> None:
        """Rows join the batch with the token their prefill's logits give."""
        room = max(0, self.max_batch_tokens // 2 - len(self._rows))  # leave prefills half the budget
        self._waiting.sort(key=lambda r: r.priority)  # the most urgent join first; stable among equals
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        for r in joining:
            try:
                seq = self._contexts[r.ctx]
                logits, seq.next_logits = seq.next_logits[None], None
                if isinstance(first := sample_rows_numpy([r], logits)[0], BaseException):
                    raise first
                if not self.emit(r, first, out, logprobs_row(r, logits[0])):
                    self._rows.append(r)
            except Exception as exc:  # this row's sampling or detokenising: it fails alone
                log.exception("engine %s: starting a decode failed", self.name)
                self.fail_row(r, exc, out)

    def _preempt(self) -> None:
        """Pause preemptive rows that hold more urgent preemptive work back (a decode waiting for one of
        ``_admit``'s ``max_batch_tokens // 2`` row slots, a prefill wanting the tokens the rows take), resume
        those that no longer do (``preemption``)."""
        if not (self._prefills or self._waiting or self._paused):  # the steady decode: nothing to weigh
            return
        wants = [Want(f.prefill.priority, 0, f.remaining) for f in self._prefills
                 if f.prefill is not None and f.prefill.preemptive]
        wants += [Want(r.priority, 1, 1) for r in self._waiting if r.preemptive]
        self._rows = self._paused.update(self._rows, wants, row_limit=self.max_batch_tokens // 2,
                                         token_budget=self.max_batch_tokens)

    def _plan(self) -> list[Part]:
        """This iteration's batch (batch.plan), prefills and scoring jobs in the policy's order: the
        most urgent first, stable among equals."""
        if len(self._prefills) > 1:
            self._prefills = deque(sorted(self._prefills, key=lambda f: f.prefill.priority))
        if self._scoring:
            self._scoring.prune_and_sort()
        return plan(self._rows, self._prefills, self._scoring, self.max_batch_tokens)

    def _run(self, parts: list[Part], out: Outbox) -> None:
        """Decode the parts in one llama_decode; should it fail, each part alone, failing alone."""
        try:
            logits = self._decode(parts)
        except DecodeFailed as exc:
            self._undo(parts)
            if exc.rc == 1 and self.prefix_cache is not None and len(self.prefix_cache):
                # No room in the KV: cached prefixes give their cells back before anything fails.
                log.info("engine %s: the KV cache is full; dropping %d cached prefixes", self.name,
                         len(self.prefix_cache))
                self.prefix_cache.clear()
                self._run(parts, out)
                return
            if len(parts) == 1:
                self._fail_part(parts[0], exc, out)
                return
            log.warning("engine %s: a batch of %d parts failed (%s); retrying part by part", self.name, len(parts), exc)
            for part in parts:
                self._run([part], out)
            return
        row = 0
        for part in parts:
            n = part.outputs  # before _finish_part moves the fill on
            self._finish_part(part, logits[row : row + n], out)
            row += n

    def _undo(self, parts: list[Part]) -> None:
        """Drop whatever a failed llama_decode left of the parts' tokens in the KV. llama.cpp removes only
        the failed ubatch's; with a stream per sequence one batch runs as several ubatches."""
        lc = llama()
        for part in parts:
            if part.kind == "decode":
                for r in part.rows:
                    lc.llama_memory_seq_rm(self._mem, self._contexts[r.ctx].seq, r.length, -1)
            else:
                lc.llama_memory_seq_rm(self._mem, part.fill.seq, part.fill.start + part.fill.done, -1)

    def _decode(self, parts: list[Part]) -> np.ndarray:
        """One llama_decode of the parts; the logits it asked for, a row each, in part order (numpy: no torch op
        on the per-token path, see ``sample_rows_numpy``)."""
        lc = llama()
        batch = self._batch
        entries, out_rank = batch_entries(parts, lambda r: self._contexts[r.ctx].seq)
        write_batch(batch, entries)
        outputs = len(out_rank)
        start = time.monotonic()
        rc = lc.llama_decode(self._ctx, batch)
        end = time.monotonic()
        if rc != 0:
            raise DecodeFailed(rc)
        self._after_decode()
        for part in parts:
            self.token_counts[part.kind] += part.count
        if outputs:
            # All requested rows, in batch order; copied, as the next decode reuses the buffer.
            buffer = float_rows(lc.llama_get_logits(self._ctx), outputs, self._n_vocab)
            # back to part order (a copy: the buffer is reused); one row, as one stream decodes, needs no reorder
            logits = buffer.copy() if outputs == 1 else buffer[np.argsort(out_rank)]
        else:
            logits = np.empty((0, self._n_vocab), dtype=np.float32)
        for kind in ("decode", "prefill", "score"):
            size = sum(len(p.rows) if kind == "decode" else 1 for p in parts if p.kind == kind)
            if size:
                self._env.observe_batch(kind, size, start, end)
        return logits

    def _finish_part(self, part: Part, logits: torch.Tensor, out: Outbox) -> None:
        if part.kind == "decode":
            self._finish_decode(part.rows, logits, out)
            return
        fill = part.fill
        fill.done += part.count
        if fill.prefill is not None:
            seq = self._contexts[fill.prefill.ctx]
            seq.length = fill.start + fill.done
            if fill.scorer is not None:
                fill.scorer.add(logits)
            if fill.remaining == 0:
                self._prefills.remove(fill)
                seq.filling, seq.next_logits = False, logits[-1].copy()  # not a view that pins the batch's
                self._offer_to_cache(seq, seq.tokens)
                out.reply(fill.prefill.reply, prefill_answer(fill.prefill, fill.cached, seq.next_logits)
                          if fill.scorer is None else fill.scorer.result())
        else:
            self._scoring.filled(fill, torch.from_numpy(logits), out)

    def _finish_decode(self, rows: list[Row], logits: np.ndarray, out: Outbox) -> None:
        tokens = sample_rows_numpy(rows, logits)
        ended = set()
        for i, (r, token) in enumerate(zip(rows, tokens)):
            r.length += 1  # its pending token is in the KV now
            self._contexts[r.ctx].length = r.length
            try:
                if isinstance(token, BaseException):
                    raise token
                finished = self.emit(r, token, out, logprobs_row(r, logits[i]))
            except Exception as exc:  # this row only
                log.exception("engine %s: a decode row failed", self.name)
                self.fail_row(r, exc, out)
                finished = True
            if finished:
                ended.add(id(r))
        if ended:
            self._rows = [r for r in self._rows if id(r) not in ended]

    def _fail_part(self, part: Part, exc: BaseException, out: Outbox) -> None:
        log.error("engine %s: %s failed alone: %s", self.name, part.kind, exc)
        if part.kind == "decode":
            for r in part.rows:
                self._rows.remove(r)
                self.fail_row(r, exc, out)
        elif part.fill.prefill is not None:
            out.reply(part.fill.prefill.reply, error=EngineError(f"prefill failed: {exc}"))
            self.release(part.fill.prefill.ctx)
        else:
            job = part.fill.job
            out.reply(job.cmd.reply, error=EngineError(f"scoring failed: {exc}"))
            self._scoring.end(job)

    # ----- when things go wrong ------------------------------------------------------------

    def recover(self, exc: BaseException, out: Outbox) -> None:
        """An iteration raised past the isolation above: fail everything in flight; contexts at rest stay."""
        error = self.error(exc)
        for r in self._rows + self._waiting + self._paused.take_all():
            self.fail_row(r, error, out)
        self._rows, self._waiting = [], []
        for fill in list(self._prefills):
            out.reply(fill.prefill.reply, error=error)
            self.release(fill.prefill.ctx)
        self._scoring.fail_all(error, out)
        for _, job in self._blocked:
            out.reply(job.reply, error=error)
        self._blocked.clear()

    def abandon(self, error: BaseException, out: Outbox) -> None:
        """The worker has stopped (and freed llama.cpp's state): answer what is left, on the event loop."""
        for r in self._rows + self._waiting + self._paused.take_all():
            out.fail_stream(r.send, error)
        for fill in self._prefills:
            out.reply(fill.prefill.reply, error=error)
        for job in self._scoring.jobs:
            out.reply(job.cmd.reply, error=error)
        for _, job in self._blocked:
            out.reply(job.reply, error=error)
        self._blocked.clear()
        self._rows, self._waiting = [], []
        self._prefills.clear()
        self._scoring.jobs.clear()
        self._contexts.clear()
        self.prefix_cache = None  # its sequences went with llama.cpp's state


class LlamaCppLLM(LLMFront):
    """The ``llama-cpp`` engine: the shared front over a llama.cpp core."""

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        super().__init__(spec.name, LlamaCppCore(spec, env))


@hookimpl
def register_engines(register):
    register("llama-cpp", LlamaCppLLM)

