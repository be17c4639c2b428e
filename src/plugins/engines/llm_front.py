"""The shared front of every in-process LLM engine, and the contract its core meets.

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

How a core plugs in (the torch engine in ``torch_llm.py`` is the reference):

1. Subclass :class:`LLMCore` and implement ``load`` (load the model, then set
   ``tokenizer``, ``vocab_size``, ``eos`` and cap ``max_context_tokens``), and the
   worker-side hooks: ``add_prefills``, ``add_scoring``, ``start_decode``,
   ``stop``, ``release``, ``step``, ``has_work``, ``recover``, ``abandon``,
   ``stats``. Override ``serving`` for per-thread setup (torch: inference mode).
2. Each worker iteration the front calls ``core.iterate(commands, out)``: the
   base class applies the new commands one by one (a command that raises fails
   its own request only), then calls ``step(out)``, the engine's one iteration
   (torch: queued scoring chunk, admissions, one decode step; llama.cpp: one
   ``llama_decode`` holding decode tokens and prefill chunks). Everything for
   the event loop goes into ``out`` (an :class:`Outbox`): reply results and
   token deltas, delivered together after the iteration.
3. Decoding rows are :class:`Row` objects made by ``new_row``; feed each sampled
   token to ``emit`` (detokenizing, stop strings, EOS, ``max_tokens`` and the
   context limit are handled there), fail a row with ``fail_row``, sample a
   batch with :func:`sample_rows` (a row whose sampling fails, fails alone).
   ``emit`` calls ``row_finished`` when a row ends (the default releases a
   ``generate`` context); ``fail_row`` and a failed ``Decode`` call ``release``.
4. The engine class the plugin registers subclasses :class:`LLMFront`, parses
   its options into a core and calls ``super().__init__(name, core)``.

The front checks token ids against ``core.vocab_size`` and scoring prompts
against ``core.max_context_tokens`` before queueing; a prefill over the context
is for the core to refuse (it knows the parent's length).

Every request carries the LLM scheduler's ``priority`` (lower first; the
``Prefill``, ``Decode`` and ``Logits`` commands and each ``Row`` have it): when a
core cannot run all its work in one iteration, it takes the most urgent first,
in arrival order among equals. A core with a prefix cache implements
``set_prefix_caching`` and ``prefix_caching_enabled`` (the front carries the
switch to the worker as a command).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ContextManager, Sequence

import anyio
import torch
from anyio.from_thread import BlockingPortal

from headrace.plugins.engines import chat, constraints
from headrace.plugins.engines.chat import ChatMessages, ToolSpecs
from headrace.plugins.engines.sampling import Detokenizer, make_generator, sample, token_logprob
from headrace.plugins.protocols import SamplingParams, TokenDelta
from headrace.types import ContextId, TokenIds

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request the engine cannot serve (unknown context, context too long...)."""


# ----- commands the front posts to the worker ---------------------------------------------


class Reply:
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
class Prefill:
    ctx: ContextId
    tokens: TokenIds
    parent: ContextId | None
    reply: Reply  # resolved with None once the context holds the tokens
    priority: int = 0  # lower runs first (the LLM scheduler's policy sets it)


@dataclass
class Decode:
    ctx: ContextId
    params: SamplingParams
    send: Any  # MemoryObjectSendStream[TokenDelta | BaseException]
    free_after: bool  # generate(): the context goes when the decode ends
    priority: int = 0


@dataclass
class Stop:
    """Stop the context's decode (if any); with ``free``, drop its KV too."""

    ctx: ContextId
    free: bool


@dataclass
class Logits:
    """A prefill-only scoring job; a core may score it a chunk at a time."""

    prompts: list[TokenIds]
    token_ids: list[int]
    reply: Reply  # resolved with a (len(prompts), len(token_ids)) float32 tensor
    scored: list[torch.Tensor] = field(default_factory=list)  # one tensor per chunk done
    next: int = 0  # the first prompt not scored yet
    priority: int = 0


@dataclass
class CacheControl:
    """Switch the core's prefix cache on or off (off drops what it holds)."""

    enabled: bool
    reply: Reply


@dataclass
class Heartbeat:
    """Answered as soon as the worker takes it, so the answer comes after the iteration in progress."""

    reply: Reply


Command = Prefill | Decode | Stop | Logits | CacheControl | Heartbeat


@dataclass
class Outbox:
    """What one worker iteration hands back to the event loop in a single call."""

    deltas: list[tuple[Any, TokenDelta | BaseException, bool]] = field(default_factory=list)
    replies: list[tuple[Reply, Any, BaseException | None]] = field(default_factory=list)

    def reply(self, reply: Reply, value: Any = None, error: BaseException | None = None) -> None:
        self.replies.append((reply, value, error))

    def fail_stream(self, send: Any, error: BaseException) -> None:
        self.deltas.append((send, error, True))


def deliver_on_loop(out: Outbox) -> None:
    for reply, value, error in out.replies:
        reply.resolve(value, error)
    for send, item, last in out.deltas:
        try:
            send.send_nowait(item)
            if last:
                send.close()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the reader went away; its Stop is already queued


# ----- the core: worker-thread side --------------------------------------------------------


@dataclass
class Row:
    """One decoding request, as the core's batch holds it."""

    ctx: ContextId
    params: SamplingParams
    send: Any
    free_after: bool
    priority: int
    generator: torch.Generator
    detok: Detokenizer
    length: int  # tokens in this row's KV
    pending: int = -1  # sampled token not yet in the KV
    produced: int = 0
    matcher: Any = None  # a constrained decode's llguidance matcher, advanced with each sampled token


class LLMCore(ABC):
    """One engine's worker-thread half: model, KV state, batching. See the module docstring."""

    reloadable = False  # True once ``unload`` drops the model and ``load`` may run again

    def __init__(self, name: str, max_context_tokens: int) -> None:
        self.name = name
        self.max_context_tokens = max_context_tokens
        # Set by load():
        self.tokenizer: Any = None  # an HF tokenizer: encode, apply_chat_template, decode
        self.vocab_size = 0
        self.eos: set[int] = set()
        self._constrainer: constraints.Constrainer | None = None  # made on the first constrained decode

    # ----- what a core implements --------------------------------------------------------

    @abstractmethod
    def load(self) -> None:
        """Load the model and tokenizer (on a worker thread, before serving)."""

    def serving(self) -> ContextManager[Any]:
        """Entered once on the worker thread around all iterations."""
        return contextlib.nullcontext()

    @abstractmethod
    def has_work(self) -> bool:
        """Whether to iterate again without waiting for a command."""

    @abstractmethod
    def add_prefills(self, jobs: list[Prefill], out: Outbox) -> None:
        """Run or queue this iteration's new prefills; reply to each (or fail it) when done."""

    @abstractmethod
    def add_scoring(self, job: Logits) -> None:
        """Queue a scoring job; ``step`` scores it (skipping it once ``job.reply.abandoned``)."""

    @abstractmethod
    def start_decode(self, cmd: Decode, out: Outbox) -> None:
        """Make a ``Row`` for a prefilled context (``new_row``) and queue it to join the batch."""

    @abstractmethod
    def stop(self, ctx: ContextId, free: bool) -> None:
        """Take the context's row (and any queued prefill of it) out of the batch; free its KV if asked."""

    @abstractmethod
    def release(self, ctx: ContextId) -> None:
        """Drop a context's KV (no error if it has none)."""

    @abstractmethod
    def step(self, out: Outbox) -> None:
        """One iteration of the engine: whatever batch it runs."""

    @abstractmethod
    def recover(self, exc: BaseException, out: Outbox) -> None:
        """An iteration raised past the core's own isolation: fail what it ran, return to a sound state."""

    @abstractmethod
    def abandon(self, error: BaseException, out: Outbox) -> None:
        """The worker has stopped: drop all state, answering what the core holds with ``error``.

        Runs on the event loop. The front then answers whatever still waits (a reply whose
        result died with the worker's last iteration, say), so answering here is optional.
        """

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """At least ``contexts`` (live KV contexts), ``decoding`` and ``waiting`` (rows)."""

    def unload(self) -> None:
        """Drop the model's memory once the worker has stopped (after ``abandon``), keeping the tokenizer,
        ``vocab_size``, ``eos`` and ``max_context_tokens``, so that requests are still checked and a later
        ``load`` serves again. The default keeps everything: such a core's engine stays pinned."""

    def footprint_bytes(self) -> int:
        """Bytes the loaded model holds (weights, preallocated caches); 0 when not loaded."""
        return 0

    def wake_after(self) -> float | None:
        """Seconds until the core wants an iteration though no command comes (a wait to time out); None: never."""
        return None

    def set_prefix_caching(self, enabled: bool) -> None:
        """Switch the prefix cache on or off (off: drop what it holds). A core without one refuses."""
        raise EngineError(f"engine {self.name!r} has no prefix cache")

    def prefix_caching_enabled(self) -> bool:
        return False

    # ----- given to every core -------------------------------------------------------------

    def iterate(self, commands: list[Command], out: Outbox) -> None:
        self.apply(commands, out)
        self.step(out)

    def apply(self, commands: list[Command], out: Outbox) -> None:
        prefills: list[Prefill] = []
        for cmd in commands:
            try:
                if isinstance(cmd, Prefill):
                    prefills.append(cmd)
                elif isinstance(cmd, Logits):
                    self.add_scoring(cmd)
                elif isinstance(cmd, Decode):
                    self.start_decode(cmd, out)
                elif isinstance(cmd, Stop):
                    # A prefill cancelled before it ran never runs.
                    prefills = [p for p in prefills if p.ctx != cmd.ctx]
                    self.stop(cmd.ctx, cmd.free)
                elif isinstance(cmd, CacheControl):
                    self.set_prefix_caching(cmd.enabled)
                    out.reply(cmd.reply)
                elif isinstance(cmd, Heartbeat):
                    out.reply(cmd.reply)
            except Exception as exc:  # this command's request fails, no other
                log.exception("engine %s: %s failed", self.name, type(cmd).__name__)
                if isinstance(cmd, Decode):
                    out.fail_stream(cmd.send, self.error(exc))
                    self.release(cmd.ctx)
                elif isinstance(cmd, (Logits, CacheControl)):
                    out.reply(cmd.reply, error=self.error(exc))
        if prefills:
            self.add_prefills(prefills, out)

    def error(self, exc: BaseException) -> EngineError:
        """``exc`` as the request's error: an EngineError as it is, anything else named by its type."""
        return exc if isinstance(exc, EngineError) else EngineError(f"engine {self.name}: {type(exc).__name__}: {exc}")

    def context_too_long(self, total: int) -> EngineError | None:
        if total >= self.max_context_tokens:
            return EngineError(f"the prompt is {total} tokens; engine {self.name!r} holds at most "
                               f"{self.max_context_tokens}")
        return None

    def new_row(self, cmd: Decode, length: int) -> Row:
        """A decoding row; a constrained one gets its matcher (compiled here, on the worker, cached per constraint)."""
        matcher = None
        if cmd.params.constraint is not None:
            if self._constrainer is None:
                self._constrainer = constraints.Constrainer(self.tokenizer, self.vocab_size, self.eos)
            try:
                matcher = self._constrainer.matcher(cmd.params.constraint)
            except constraints.ConstraintError as exc:
                raise EngineError(f"the output constraint does not compile: {exc}") from None
        return Row(ctx=cmd.ctx, params=cmd.params, send=cmd.send, free_after=cmd.free_after, priority=cmd.priority,
                   generator=make_generator(cmd.params.seed), detok=Detokenizer(self.tokenizer, cmd.params.stop),
                   length=length, matcher=matcher)

    def emit(self, r: Row, token: int, out: Outbox, logits: torch.Tensor | None = None) -> bool:
        """Record one sampled token of ``r`` (its KV holds ``r.length`` tokens); True when the row is finished.

        ``logits``: the row (V,) the token was sampled from, for a request that asked for logprobs."""
        r.produced += 1
        wanted = r.params.logprobs
        logprobs = (token_logprob(logits, token, wanted),) if wanted is not None and logits is not None else ()
        finish = None
        if token in self.eos:
            text, finish = r.detok.flush(), "stop"
        else:
            if r.matcher is not None:
                try:
                    constraints.advance(r.matcher, token)
                except constraints.ConstraintError as exc:
                    raise EngineError(str(exc)) from None
            text, hit_stop = r.detok.add(token)
            if hit_stop or (r.matcher is not None and r.matcher.is_stopped()):
                # A stop string, or a grammar with nothing left to add: the row is done.
                text, finish = text + ("" if hit_stop else r.detok.flush()), "stop"
            elif r.produced >= r.params.max_tokens or r.length + 1 >= self.max_context_tokens:
                text, finish = text + r.detok.flush(), "length"
        r.pending = token
        out.deltas.append((r.send, TokenDelta(text=text, token_ids=[token], finish_reason=finish,
                                                      logprobs=logprobs), finish is not None))
        if finish is not None:
            self.row_finished(r)
        return finish is not None

    def row_finished(self, r: Row) -> None:
        """A row ended normally (its last delta is in the outbox)."""
        if r.free_after:
            self.release(r.ctx)

    def fail_row(self, r: Row, exc: BaseException, out: Outbox) -> None:
        out.fail_stream(r.send, self.error(exc))
        self.release(r.ctx)


def sample_rows(rows: Sequence[Row], logits: torch.Tensor) -> list[int | BaseException]:
    """One token per row of ``logits`` (constrained rows masked to what their grammar allows); should sampling
    the batch fail, each row on its own, failing alone."""
    try:
        mask = constraints.bitmask([r.matcher for r in rows], logits.shape[-1])
        return list(sample(logits, [r.params for r in rows], [r.generator for r in rows], mask))
    except Exception:
        tokens: list[int | BaseException] = []
        for i, r in enumerate(rows):
            try:
                tokens.append(sample_row(r, logits[i]))
            except Exception as exc:
                tokens.append(exc)
        return tokens


def sample_row(r: Row, logits: torch.Tensor) -> int:
    """One token for one row from its logits (V,): a decode's first token, from its prefill."""
    mask = constraints.bitmask([r.matcher], logits.shape[-1])
    return sample(logits.unsqueeze(0), [r.params], [r.generator], mask)[0]


# ----- the front: event-loop side ----------------------------------------------------------


def check_token_ids(tokens: Sequence[int], vocab_size: int, engine: str) -> None:
    """Refuse token ids the model has no embedding for, before they can fail a batch (every engine's front)."""
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise EngineError(f"token id {token!r} is not in the vocabulary of engine {engine!r} "
                              f"(0 to {vocab_size - 1})")


class LLMFront:
    """The ``LLMEngine`` protocol over one core and its worker thread."""

    kind = "llm"
    reports_logprobs = True  # every core samples through emit(), which computes them

    def __init__(self, name: str, core: LLMCore) -> None:
        self.name = name
        self.core = core
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._portal: BlockingPortal | None = None
        self._ctx_ids = itertools.count()
        self._live: set[ContextId] = set()  # contexts not yet freed, as the event loop sees them
        # Every request awaiting the worker, so that its death answers them all.
        self._awaiting: set[Reply] = set()
        self._streams: set[Any] = set()  # send ends of open decode streams
        self._heartbeat: Reply | None = None  # the one heartbeat the worker has not answered yet

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
        await anyio.to_thread.run_sync(self.core.load)
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
            finally:
                self._commands.put(None)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(worker.join)
                self._portal = None
                self._fail_outstanding()
                # Cancelled (shutdown, or the daemon evicting us) or failed: the model's memory goes;
                # the next run() loads it again.
                self.core.unload()
        # Only a bug ends the worker while serving: say so (outside the portal's task group, so
        # unwrapped), and let the pool mark us failed.
        raise EngineError(f"engine {self.name!r}: its worker thread stopped")

    # ----- tokenizing --------------------------------------------------------------------
    # Synchronous, as the protocol has them: async callers run them on a worker thread (graph
    # ops, the OpenAI routes for large inputs, the LLM reranker), which serves every LLM engine.

    def encode(self, text: str) -> TokenIds:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_tokens(self, messages: ChatMessages, tools: ToolSpecs | None = None,
                    add_generation_prompt: bool = True) -> TokenIds:
        return chat.apply_template(self.tokenizer, messages, tools, tokenize=True,
                                   add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, messages: ChatMessages, tools: ToolSpecs | None = None) -> str:
        return chat.apply_template(self.tokenizer, messages, tools, tokenize=False)

    # ----- requests --------------------------------------------------------------------------

    def new_context_id(self) -> ContextId:
        return f"{self.name}-ctx-{next(self._ctx_ids)}"

    async def prefill(self, ctx: ContextId, tokens: Sequence[int], parent: ContextId | None = None, *,
                      priority: int = 0) -> None:
        self._require_running()
        if ctx in self._live:
            raise EngineError(f"context {ctx!r} already exists")
        if parent is not None and parent not in self._live:
            raise EngineError(f"parent context {parent!r} does not exist")
        if not tokens:
            raise EngineError("prefill needs at least one token")
        self._check_tokens(tokens)
        reply = Reply()
        self._live.add(ctx)
        self._commands.put(Prefill(ctx, list(tokens), parent, reply, priority))
        try:
            await self._wait(reply)
        except BaseException:
            # Cancelled or failed: the worker frees whatever it made (commands run in order).
            self._commands.put(Stop(ctx, free=True))
            self._live.discard(ctx)
            raise

    async def decode(self, ctx: ContextId, params: SamplingParams, *, priority: int = 0) -> AsyncIterator[TokenDelta]:
        async for delta in self._decode(ctx, params, free_after=False, priority=priority):
            yield delta

    async def free(self, ctx: ContextId) -> None:
        if ctx in self._live:
            self._live.discard(ctx)
            self._commands.put(Stop(ctx, free=True))

    async def generate(self, tokens: Sequence[int], params: SamplingParams, *,
                       priority: int = 0) -> AsyncIterator[TokenDelta]:
        ctx = self.new_context_id()
        await self.prefill(ctx, tokens, priority=priority)
        try:
            async for delta in self._decode(ctx, params, free_after=True, priority=priority):
                yield delta
        finally:
            self._live.discard(ctx)

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int], *,
                                priority: int = 0) -> torch.Tensor:
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
        reply = Reply()
        self._commands.put(Logits(prompts, list(token_ids), reply, priority=priority))
        try:
            return await self._wait(reply)
        except BaseException:
            reply.abandoned = True  # cancelled: the worker drops the rest of the job
            raise

    def stats(self) -> dict[str, int]:
        return self.core.stats()

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

    async def _decode(self, ctx: ContextId, params: SamplingParams, free_after: bool,
                      priority: int) -> AsyncIterator[TokenDelta]:
        self._require_running()
        if ctx not in self._live:
            raise EngineError(f"context {ctx!r} does not exist")
        # One item per token at most, so the buffer bounds memory and the worker never blocks.
        send, receive = anyio.create_memory_object_stream[TokenDelta | BaseException](params.max_tokens + 1)
        self._streams.add(send)
        self._commands.put(Decode(ctx, params, send, free_after, priority))
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
            self._streams.discard(send)
            if not finished:
                # Abandoned or cancelled: the row leaves the batch at the next step.
                self._live.discard(ctx)
                self._commands.put(Stop(ctx, free=True))
            elif free_after:
                self._live.discard(ctx)

    # ----- the worker thread ---------------------------------------------------------------

    def _worker_main(self, portal: BlockingPortal, ended: anyio.Event) -> None:
        try:
            with self.core.serving():
                while True:
                    commands = self._take_commands(block=not self.core.has_work(), timeout=self.core.wake_after())
                    if commands is None:
                        break
                    out = Outbox()
                    try:
                        self.core.iterate(commands, out)
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
        if not out.deltas and not out.replies:
            return True
        portal = self._portal
        if portal is None:
            return False
        try:
            portal.call(deliver_on_loop, out)
        except (RuntimeError, concurrent.futures.CancelledError):  # the event loop is shutting down
            return False
        return True

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
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                pass  # the reader is gone, or finished: nothing waits
            send.close()
