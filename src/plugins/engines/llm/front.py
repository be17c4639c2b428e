"""The shared front of every in-process LLM engine, on the event loop.

An in-process LLM engine is two halves, as vLLM splits ``AsyncLLM`` from its
engine core:

- the **front** (:class:`LLMFront`, this module, on the event loop) implements
  the ``LLMEngine`` protocol: it tokenizes, checks requests, posts commands to one queue, gives each decode a
  bounded output stream, turns a cancelled or abandoned request into a ``Stop``,
  owns the worker thread's lifetime, answers the watchdog's ``heartbeat`` once the
  worker comes round its loop, receives each iteration's results through a
  ``BlockingPortal``, and when the worker dies fails everything outstanding and
  ends ``run`` with an error (the pool marks the engine failed);
- the **core** (a subclass of :class:`LLMCore`, per engine, on the worker
  thread) owns the model, the KV state and the batch of each iteration. Only the
  worker thread touches it, so it needs no locks.

The front is this module; the core's base class and its contract are in ``core``,
the commands and results they pass each other in ``messages``.

The front checks token ids against ``core.vocab_size`` (with the other request checks in
``request_checks``) and scoring prompts against ``core.max_context_tokens`` before queueing; a prefill over the context
is for the core to refuse (it knows the parent's length).

Every request carries the LLM scheduler's ``priority`` (lower first; the
``Prefill``, ``Decode`` and ``Logits`` commands and each ``Row`` have it): when a
core cannot run all its work in one iteration, it takes the most urgent first,
in arrival order among equals. A request sent ``preemptive`` (the scheduler's policy
preempts) may also pause a lower-ranked preemptive decode, where the core can
(``pauses_decodes``; see ``preemption``). A core with a prefix cache implements
``set_prefix_caching`` and ``prefix_caching_enabled`` (the front carries the
switch to the worker as a command); one whose ``prefix_cache`` is a ``PrefixCache``
gets pins (``pin_prefix``, the ``Pin`` command) from the base class. A decode sent
``keep_context`` (a named program's turn) lets a core that ``keeps_contexts`` cache
its whole context once it ends (``KeepsContexts``). A request's ``cache_partition`` (``IsolatesCaches``)
rides on its ``Prefill`` (and a pin's on its ``Pin``): a core that ``isolates_caches`` reuses cached KV only
within it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from dataclasses import replace
from typing import Any, AsyncIterator, Sequence

import anyio
import torch
from anyio.from_thread import BlockingPortal

from headrace.plugins.engines.llm import chat
from headrace.plugins.engines.llm.chat import ChatMessages, ToolSpecs
from headrace.plugins.engines.llm.core import LLMCore
from headrace.plugins.engines.llm.inbox import LoopInbox
from headrace.plugins.engines.llm.messages import (CacheControl, Command, Decode, EngineError, EngineFailed, Heartbeat,
                                                   Logits, Outbox, Pin, Prefill, PrepareDocuments, Reply, Stop,
                                                   TokenStream, deliver_on_loop)
from headrace.plugins.engines.llm.prompt_scores import PromptScoring
from headrace.plugins.engines.llm.request_checks import (check_documents, check_partition, check_priority,
                                                            check_token_ids)
from headrace.plugins.protocols import MAX_TOP_LOGPROBS, PromptLogprobs, SamplingParams, TokenDelta
from headrace.types import ContextId, TokenIds

log = logging.getLogger(__name__)


# Contexts one engine's scoring through the cache holds open at once (its prompts' prefills batch together).
CACHED_SCORING_CONTEXTS = 8


class LLMFront:
    """The ``LLMEngine`` protocol over one core and its worker thread."""

    kind = "llm"
    reports_logprobs = True  # every core samples through emit(), which computes them
    # The command that opens a generate()'s context. A core whose decode computes its prompt itself
    # (vLLM: one request for both) takes a subclass that only records the tokens.
    generate_prefill: type[Prefill] = Prefill

    def __init__(self, name: str, core: LLMCore) -> None:
        self.name = name
        self.core = core
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._portal: BlockingPortal | None = None
        self._inbox: LoopInbox[Outbox] | None = None  # the worker's outboxes, on their way to the event loop
        self._ctx_ids = itertools.count()
        self._live: set[ContextId] = set()  # contexts not yet freed, as the event loop sees them
        # Every request awaiting the worker, so that its death answers them all.
        self._awaiting: set[Reply] = set()
        self._streams: set[TokenStream] = set()  # open decode streams
        self._heartbeat: Reply | None = None  # the one heartbeat the worker has not answered yet
        self._scoring_contexts: anyio.CapacityLimiter | None = None  # made on the loop, on first use

    # What the daemon's request checks read (valid once run() has loaded the model).
    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def max_context_tokens(self) -> int:
        return self.core.max_context_tokens

    # ----- lifetime ------------------------------------------------------------------------

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        loaded = anyio.Event()
        if not self.core.load_on_worker:
            await anyio.to_thread.run_sync(self.core.load)
            loaded.set()
        worker_ended = anyio.Event()
        load_error: list[BaseException] = []  # also the EngineFailed that stopped the worker, if one did
        async with BlockingPortal() as portal:
            self._portal, self._inbox = portal, LoopInbox(asyncio.get_running_loop(), deliver_on_loop)
            worker = threading.Thread(
                target=self._worker_main, args=(portal, loaded, worker_ended, load_error), name=f"headrace-{self.name}",
                daemon=True,
            )
            worker.start()
            try:
                await loaded.wait()
                if load_error:
                    raise load_error[0]
                self._set_chat_template()
                task_status.started()
                await worker_ended.wait()
            finally:
                self._commands.put(None)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(worker.join)
                self._inbox.close()  # every outbox the worker put, delivered before anything fails
                self._portal = self._inbox = None
                self._fail_outstanding()
                # Cancelled (shutdown, or the daemon evicting us) or failed: the model's memory goes;
                # the next run() loads it again.
                self.core.unload()
        # Only a failed engine (its core says how) or a bug ends the worker while serving: say so (outside
        # the portal's task group, so unwrapped), and let the pool mark us failed.
        if load_error and isinstance(load_error[0], EngineFailed):
            raise load_error[0]
        raise EngineError(f"engine {self.name!r}: its worker thread stopped")

    # ----- tokenizing --------------------------------------------------------------------
    # Synchronous, as the protocol has them: async callers run them on a worker thread (graph
    # ops, the OpenAI routes for large inputs, the LLM reranker), which serves every LLM engine.

    # ``encode`` is a piece of a prompt (no special tokens: pieces are concatenated); ``prompt_tokens`` a whole
    # prompt, with the special tokens the model's tokenizer adds (Gemma's BOS; SmolLM2's adds none).

    def encode(self, text: str) -> TokenIds:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_tokens(self, text: str) -> TokenIds:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def chat_tokens(self, messages: ChatMessages, tools: ToolSpecs | None = None,
                    add_generation_prompt: bool = True) -> TokenIds:
        self._require_template()
        return chat.apply_template(self.tokenizer, messages, tools, tokenize=True,
                                   add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, messages: ChatMessages, tools: ToolSpecs | None = None) -> str:
        self._require_template()
        return chat.apply_template(self.tokenizer, messages, tools, tokenize=False)

    def _require_template(self) -> None:
        if not chat.has_template(self.tokenizer):
            raise chat.NoChatTemplate(self.name)

    def _set_chat_template(self) -> None:
        """The ``chat_template`` option (the core's, as its engine parsed it) over the model's, once it is loaded;
        the template's turn end (``chat.turn_end_ids``) ends a decode as the EOS does."""
        template = getattr(self.core, "chat_template", None)
        if template is not None:
            self.core.tokenizer.chat_template = template
        self.core.eos |= chat.turn_end_ids(self.core.tokenizer)  # before any request: the worker reads it

    # ----- requests --------------------------------------------------------------------------

    def new_context_id(self) -> ContextId:
        return f"{self.name}-ctx-{next(self._ctx_ids)}"

    async def prefill(self, ctx: ContextId, tokens: Sequence[int], parent: ContextId | None = None, *,
                      priority: int = 0, preemptive: bool = False, cache_partition: str = "",
                      documents: Sequence[tuple[int, int]] = ()) -> int | None:
        cached = await self._open(Prefill, ctx, tokens, parent, priority, preemptive, partition=cache_partition,
                                  documents=check_documents(documents, len(tokens)))
        return cached if isinstance(cached, int) else None

    @property
    def places_documents(self) -> bool:
        """``PlacesDocuments``: whether a prefill's ``documents`` may be placed from KV computed once."""
        return self.core.places_documents

    async def prepare_documents(self, documents: Sequence[Sequence[int]], *, cache_partition: str = "") -> int:
        """``PlacesDocuments``: compute and keep each document's KV (each tokenized alone) in the partition; how
        many are held now (0 from an engine that places none)."""
        self._require_running()
        check_partition(cache_partition)
        docs = [list(d) for d in documents]
        for doc in docs:
            self._check_tokens(doc)
        reply = Reply()
        self._commands.put(PrepareDocuments(docs, reply, cache_partition))
        return await self._wait(reply)

    async def prompt_logprobs(self, tokens: Sequence[int], *, parent: ContextId | None = None, top: int = 0,
                              full: bool = False, priority: int = 0, cache_partition: str = "") -> PromptLogprobs:
        if not self.scores_prompts:
            raise EngineError(f"engine {self.name!r} does not score prompts (no prompt logprobs)")
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise EngineError(f"top must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        ctx = self.new_context_id()
        try:
            return await self._open(Prefill, ctx, tokens, parent, priority, scoring=PromptScoring(top, bool(full)),
                                    partition=cache_partition)
        finally:
            await self.free(ctx)

    async def _open(self, command: type[Prefill], ctx: ContextId, tokens: Sequence[int], parent: ContextId | None,
                    priority: int, preemptive: bool = False, scoring: PromptScoring | None = None,
                    partition: str = "", documents: tuple[tuple[int, int], ...] = (),
                    next_logits_of: tuple[int, ...] = ()) -> Any:
        """Queue the context's prefill and wait for it; the core's reply: the prompt tokens its prefix cache held
        (None: the core does not say), or a scored prefill's ``PromptLogprobs``."""
        self._require_running()
        check_priority(priority)
        check_partition(partition)
        if ctx in self._live:
            raise EngineError(f"context {ctx!r} already exists")
        if parent is not None and parent not in self._live:
            raise EngineError(f"parent context {parent!r} does not exist")
        if not tokens:
            raise EngineError("prefill needs at least one token")
        self._check_tokens(tokens)
        reply = Reply()
        self._live.add(ctx)
        prefill = command(ctx, list(tokens), parent, reply, priority, preemptive=bool(preemptive))
        prefill.scoring, prefill.partition, prefill.documents = scoring, partition, documents
        prefill.next_logits_of = next_logits_of
        self._commands.put(prefill)
        try:
            return await self._wait(reply)
        except BaseException:
            # Cancelled or failed: the worker frees whatever it made (commands run in order).
            self._commands.put(Stop(ctx, free=True))
            self._live.discard(ctx)
            raise

    async def decode(self, ctx: ContextId, params: SamplingParams, *, priority: int = 0,
                     preemptive: bool = False, keep_context: bool = False) -> AsyncIterator[TokenDelta]:
        async for delta in self._decode(ctx, params, free_after=False, priority=priority, preemptive=preemptive,
                                        keep_context=keep_context):
            yield delta

    async def free(self, ctx: ContextId) -> None:
        if ctx in self._live:
            self._live.discard(ctx)
            self._commands.put(Stop(ctx, free=True))

    async def generate(self, tokens: Sequence[int], params: SamplingParams, *,
                       priority: int = 0, preemptive: bool = False, keep_context: bool = False,
                       cache_partition: str = "") -> AsyncIterator[TokenDelta]:
        self._check_sampling(params)  # before the prefill: refused, nothing is left held
        ctx = self.new_context_id()
        cached = await self._open(self.generate_prefill, ctx, tokens, None, priority, preemptive,
                                  partition=cache_partition)
        cached = cached if isinstance(cached, int) else None
        try:
            async for delta in self._decode(ctx, params, free_after=True, priority=priority, preemptive=preemptive,
                                            keep_context=keep_context):
                if cached:  # the request's first delta says what its prompt found cached
                    delta, cached = replace(delta, cached_tokens=cached), None
                yield delta
        finally:
            self._live.discard(ctx)

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int], *,
                                priority: int = 0) -> torch.Tensor:
        self._require_running()
        check_priority(priority)
        prompts = self._scoring_prompts(prompts, token_ids)
        if not prompts:
            return torch.empty(0, len(token_ids), dtype=torch.float32)
        reply = Reply()
        self._commands.put(Logits(prompts, list(token_ids), reply, priority=priority))
        try:
            return await self._wait(reply)
        except BaseException:
            reply.abandoned = True  # cancelled: the worker drops the rest of the job
            raise

    def _scoring_prompts(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int]) -> list[list[int]]:
        prompts = [list(p) for p in prompts]
        self._check_tokens(token_ids)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineError(f"prompt {i} to score is empty")
            if len(prompt) >= self.max_context_tokens:
                raise EngineError(f"prompt {i} to score is {len(prompt)} tokens; engine {self.name!r} holds "
                                  f"at most {self.max_context_tokens}")
            self._check_tokens(prompt)
        return prompts

    @property
    def scores_through_cache(self) -> bool:
        return self.core.scores_through_cache

    async def next_token_logits_cached(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int], *,
                                       priority: int = 0, cache_partition: str = "") -> tuple[torch.Tensor, int]:
        """``ScoresThroughCache``: each prompt a prefill of its own (its cached prefix restored, what it computes
        cached for the next one), freed once scored; at most ``CACHED_SCORING_CONTEXTS`` open at once, so a long
        scoring job leaves the engine's contexts to its decodes."""
        if not self.scores_through_cache:
            raise EngineError(f"engine {self.name!r} does not score through its prefix cache")
        self._require_running()
        check_priority(priority)
        check_partition(cache_partition)
        prompts = self._scoring_prompts(prompts, token_ids)
        ids = tuple(token_ids)
        result = torch.empty(len(prompts), len(ids), dtype=torch.float32)
        cached = 0
        if self._scoring_contexts is None:
            self._scoring_contexts = anyio.CapacityLimiter(CACHED_SCORING_CONTEXTS)
        limiter = self._scoring_contexts

        async def score(i: int, prompt: list[int]) -> None:
            nonlocal cached
            async with limiter:
                ctx = self.new_context_id()
                try:
                    held, row = await self._open(Prefill, ctx, prompt, None, priority, partition=cache_partition,
                                                 next_logits_of=ids)
                finally:
                    await self.free(ctx)
            result[i] = row
            cached += held

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(prompts):
                tg.start_soon(score, i, prompt)
        return result, cached

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    @property
    def pauses_decodes(self) -> bool:
        """``PausesDecodes``: whether the core pauses preemptive decodes for more urgent preemptive work."""
        return self.core.pauses_decodes

    @property
    def scores_prompts(self) -> bool:
        return self.core.scores_prompts

    @property
    def keeps_contexts(self) -> bool:
        """``KeepsContexts``: whether a decode sent ``keep_context`` may leave its whole context cached."""
        return self.core.keeps_contexts

    @property
    def isolates_caches(self) -> bool:
        """``IsolatesCaches``: whether the core keeps cached KV apart by ``cache_partition``."""
        return self.core.isolates_caches

    @property
    def reloadable(self) -> bool:
        """``Reloadable``: whether the core drops its model when ``run`` ends and loads it again on the next."""
        return self.core.reloadable

    def footprint_bytes(self) -> int:
        return self.core.footprint_bytes()

    def prefix_caching_enabled(self) -> bool:
        return self.core.prefix_caching_enabled()

    async def set_prefix_caching(self, enabled: bool) -> None:
        self._require_running()
        reply = Reply()
        self._commands.put(CacheControl(enabled, reply))
        await self._wait(reply)

    def prefix_cache_budget(self) -> tuple[int, int]:
        """``SizesPrefixCache``: (the prefix cache's budget, its pins') in tokens; (0, 0): configured without one."""
        return self.core.prefix_cache_budget()

    async def set_prefix_cache_budget(self, tokens: int, pin_tokens: int) -> None:
        """``SizesPrefixCache``: a ``CacheControl`` command with the new budget (the cache emptied)."""
        self._require_running()
        reply = Reply()
        self._commands.put(CacheControl(self.prefix_caching_enabled(), reply, (tokens, pin_tokens)))
        await self._wait(reply)

    async def pin_prefix(self, tokens: Sequence[int], ttl: float | None, *, owner: str | None = None,
                         next_use: float | None = None, cache_partition: str = "") -> int:
        """``PinsPrefixes``: a ``Pin`` command, answered after the iteration in progress."""
        self._require_running()
        check_partition(cache_partition)
        reply = Reply()
        self._commands.put(Pin(list(tokens), ttl, owner, next_use, reply, partition=cache_partition))
        return await self._wait(reply)

    async def unpin_prefix(self, owner: str) -> None:
        self._require_running()
        reply = Reply()
        self._commands.put(Pin([], 0, owner, None, reply))
        await self._wait(reply)

    async def heartbeat(self) -> None:
        """``WorkerHeartbeat``: wait for the worker to come round its loop.

        One heartbeat at a time: a caller that gave up on a wedged worker waits on the same one
        next time, so the queue never fills with heartbeats. One answered after its caller gave
        up says nothing of now: a fresh one goes.
        """
        self._require_running()
        if self._heartbeat is not None and self._heartbeat.done.is_set():
            self._awaiting.discard(self._heartbeat)
            self._heartbeat = None
        if self._heartbeat is None:
            self._heartbeat = Reply()
            self._awaiting.add(self._heartbeat)  # the worker's death answers it too
            self._commands.put(Heartbeat(self._heartbeat))
        reply = self._heartbeat
        try:
            await reply.wait()
        finally:
            if reply.done.is_set():
                self._awaiting.discard(reply)
                if self._heartbeat is reply:
                    self._heartbeat = None

    async def _wait(self, reply: Reply) -> Any:
        self._awaiting.add(reply)
        try:
            return await reply.wait()
        finally:
            self._awaiting.discard(reply)

    def _require_running(self) -> None:
        if self._portal is None:
            raise EngineError(f"engine {self.name!r} is not running")

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        check_token_ids(tokens, self.vocab_size, self.name)

    def _check_sampling(self, params: SamplingParams) -> None:
        """The token ids of the sampling settings: one past the vocabulary would fail its row at the first step."""
        self._check_tokens([t for t, _ in params.logit_bias] + list(params.stop_token_ids))

    async def _decode(self, ctx: ContextId, params: SamplingParams, free_after: bool,
                      priority: int, preemptive: bool = False, keep_context: bool = False) -> AsyncIterator[TokenDelta]:
        self._require_running()
        check_priority(priority)
        self._check_sampling(params)
        if ctx not in self._live:
            raise EngineError(f"context {ctx!r} does not exist")
        # One item per token at most (the worker never blocks on it); one loop wake per delivery.
        stream = TokenStream()
        self._streams.add(stream)
        self._commands.put(Decode(ctx, params, stream, free_after, priority, preemptive=bool(preemptive),
                                  keep_context=bool(keep_context)))
        finished = False
        try:
            async for item in stream:
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    break
        finally:
            stream.leave()
            self._streams.discard(stream)
            if not finished:
                # Abandoned or cancelled: the row leaves the batch at the next step.
                self._live.discard(ctx)
                self._commands.put(Stop(ctx, free=True))
            elif free_after:
                self._live.discard(ctx)

    # ----- the worker thread ---------------------------------------------------------------

    def _worker_main(self, portal: BlockingPortal, loaded: anyio.Event, ended: anyio.Event,
                     load_error: list[BaseException]) -> None:
        # faulthandler's dump after a fatal signal names threads by id only: this line maps it to the engine.
        log.info("engine %s: worker thread 0x%016x", self.name, threading.get_ident())
        try:
            if self.core.load_on_worker:
                try:
                    self.core.load()
                except BaseException as exc:
                    log.exception("engine %s: loading failed", self.name)
                    load_error.append(exc)
                    return
                finally:
                    portal.call(loaded.set)
            with self.core.serving():
                while True:
                    commands = self._take_commands(block=not self.core.has_work(), timeout=self.core.wake_after())
                    if commands is None:
                        break
                    out = Outbox(early=self._deliver)
                    try:
                        self.core.iterate(commands, out)
                    except EngineFailed as exc:
                        log.error("engine %s: %s", self.name, exc)
                        load_error.append(exc)
                        self._deliver(out)
                        break
                    except Exception as exc:  # a last resort: the core isolates what it can
                        log.exception("engine %s: an iteration failed", self.name)
                        self.core.recover(exc, out)
                    if not self._deliver(out):
                        break
        except BaseException:
            log.exception("engine %s: worker thread crashed", self.name)
        finally:
            try:
                portal.call(ended.set)
            except (RuntimeError, concurrent.futures.CancelledError):  # the event loop is shutting down
                pass

    def _take_commands(self, block: bool, timeout: float | None = None) -> list[Command] | None:
        """Everything queued now (waiting for one command first when idle, at most ``timeout`` s); None means stop."""
        commands: list[Command | None] = []
        try:
            commands.append(self._commands.get(timeout=timeout) if block else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        if None in commands:
            return None
        return commands  # type: ignore[return-value]

    def _deliver(self, out: Outbox) -> bool:
        """Hand the iteration's results to the event loop without waiting for it to run them.

        Not a blocking portal call: waiting for the loop to take each outbox put a thread handoff
        and whatever the loop was busy with (streaming the last tokens out) between every two
        decode steps. Nor ``call_soon_threadsafe``, whose wake-up gives the GIL to the loop until it
        has run all it had (``inbox``). Outboxes are delivered in order, and every one before the
        loop fails what is left (``run`` closes the inbox once the worker is joined)."""
        if not out.deltas and not out.replies:
            return True
        inbox = self._inbox
        return inbox is not None and inbox.put(out)

    def _fail_outstanding(self) -> None:
        """On the event loop, once the worker has stopped: answer every request still waiting on it."""
        error = EngineError(f"engine {self.name!r} stopped")
        while True:  # drop what the worker never took
            try:
                self._commands.get_nowait()
            except queue.Empty:
                break
        out = Outbox()
        self.core.abandon(error, out)
        deliver_on_loop(out)
        self._live.clear()
        for reply in self._awaiting:
            if not reply.done.is_set():
                reply.resolve(None, error)
        for send in self._streams:
            try:
                send.send_nowait(error)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the reader is gone, or finished: nothing waits
            send.close()
