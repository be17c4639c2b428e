"""The worker-thread half of an in-process LLM engine: the :class:`LLMCore` base and its rows.

How a core plugs in (the torch engine in ``torch_engine/engine.py`` is the reference):

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
   An engine that cannot go on (a process of it died) raises ``EngineFailed``
   from ``step``: the worker stops, and the engine fails.
3. Decoding rows are :class:`Row` objects made by ``new_row``; feed each sampled
   token to ``emit`` (detokenizing, stop strings, EOS, ``max_tokens`` and the
   context limit are handled there), fail a row with ``fail_row``, sample a
   batch with :func:`sample_rows` (a row whose sampling fails, fails alone).
   ``emit`` calls ``row_finished`` when a row ends (the default releases a
   ``generate`` context); ``fail_row`` and a failed ``Decode`` call ``release``.
4. The engine class the plugin registers subclasses :class:`LLMFront`
   (``front``), parses its options into a core and calls
   ``super().__init__(name, core)``.

The front checks token ids against ``core.vocab_size`` and scoring prompts
against ``core.max_context_tokens`` before queueing; a prefill over the context
is for the core to refuse (it knows the parent's length).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ContextManager, Sequence

import numpy as np
import torch

from headrace.plugins.engines.kvreuse.prefix_cache import PinPolicy
from headrace.plugins.engines.llm import constraints
from headrace.plugins.engines.llm.messages import (CacheControl, Command, Decode, EngineError, Heartbeat, Logits,
                                                   Outbox, Pin, Prefill, PrepareDocuments, Stop)
from headrace.plugins.engines.llm.sampling import (NO_HISTORY, Detokenizer, History, is_greedy, make_generator, sample,
                                                   token_logprob)
from headrace.plugins.protocols import SamplingParams, TokenDelta
from headrace.types import ContextId

log = logging.getLogger(__name__)


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
    preemptive: bool = False  # takes part in preemption (``preemption``): may be paused, may pause others
    paused_at: float | None = None  # when it last left the batch for more urgent work; None: not paused
    paused_for: float = 0.0  # seconds paused before that, in all
    keep_context: bool = False  # its request may come back repeating it all (``Decode.keep_context``)
    history: History = NO_HISTORY  # what its penalties and min_tokens read (its settings all off: nothing)
    held: TokenDelta | None = None  # tokens not sent yet (``stream_interval``)


class LLMCore(ABC):
    """One engine's worker-thread half: model, KV state, batching. See the module docstring."""

    reloadable = False  # True once ``unload`` drops the model and ``load`` may run again
    # True: the front calls ``load`` on its worker thread, before serving (an engine whose state
    # belongs to the thread that built it, as vLLM's CPU worker pins its threads); False: on a
    # thread of its own, before the worker starts.
    load_on_worker = False
    # True: the core pauses preemptive decodes for more urgent preemptive work (``preemption``); the front
    # passes the commands' ``preemptive`` flag either way, and a core that cannot pause ignores it.
    pauses_decodes = False
    # True: the core caches a finished row's whole context when its ``Decode.keep_context`` asks (``KeepsContexts``);
    # the front passes the flag either way, and a core that caches prompts only ignores it.
    keeps_contexts = False
    # True: the core honours ``Prefill.scoring`` (teacher-forced scores, ``ScoresPrompts``).
    scores_prompts = False
    # True: the core keeps cached KV apart by ``Prefill.partition`` and ``Pin.partition`` (``IsolatesCaches``): a
    # prefill reuses, waits for and adds to only its own partition's. A core whose engine keeps a cache of its
    # own that it cannot partition says False, and the daemon refuses a salted request to it.
    isolates_caches = False
    # True: the core may place a prefill's ``documents`` from KV computed once (``PrepareDocuments``) rather than
    # prefill them (``PlacesDocuments``); False: documents are prefilled like any other tokens.
    places_documents = False
    # True: the core honours ``Prefill.next_logits_of`` (``ScoresThroughCache``): a prefill's reply carries its
    # next-token logits of those ids, so a scoring prompt reuses and adds to the prefix cache and tiers.
    scores_through_cache = False
    # A core with a prefix cache sets both in its __init__: its budget in tokens (0: none) and its pins' policy.
    prefix_cache_tokens = 0
    _pins: PinPolicy | None = None

    def __init__(self, name: str, max_context_tokens: int, stream_interval: int = 1) -> None:
        self.name = name
        self.max_context_tokens = max_context_tokens
        # vLLM's and SGLang's ``stream_interval``: a row's tokens go out in deltas of this many (its first and last
        # at once), so the event loop wakes, frames and writes once per that many tokens, not per token.
        self.stream_interval = stream_interval
        # Set by load():
        self.tokenizer: Any = None  # an HF tokenizer: encode, apply_chat_template, decode
        self.vocab_size = 0
        self.eos: set[int] = set()
        self._constrainer: constraints.Constrainer | None = None  # made on the first constrained decode
        # Prompt tokens the engine fills a second (a moving average over iterations that filled some; one
        # that also decoded counts its whole time, so this errs low): what the retention TTL weighs a
        # context's refill by. None until measured (a core that keeps ``token_counts``).
        self.tokens_per_second: float | None = None

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

    def prefix_cache_budget(self) -> tuple[int, int]:
        """(The prefix cache's budget, its pins' budget) in tokens; (0, 0): configured without one."""
        return (self.prefix_cache_tokens, self._pins.pin_tokens) if self._pins is not None else (0, 0)

    def resize_prefix_cache(self, tokens: int, pin_tokens: int) -> None:
        """A new budget for the prefix cache and its pins (a benchmark's memory pressure), from an empty cache:
        what it holds is dropped, and it stays on or off as it was. A core configured without one refuses."""
        if self.prefix_cache_tokens <= 0 or self._pins is None:
            raise EngineError(f"engine {self.name!r} has no prefix cache")
        if tokens < 1 or not 0 <= pin_tokens <= tokens:
            raise EngineError(f"engine {self.name!r}: a prefix cache of {tokens} tokens cannot pin {pin_tokens}")
        enabled = self.prefix_caching_enabled()
        self.set_prefix_caching(False)
        self.prefix_cache_tokens, self._pins = tokens, dataclasses.replace(self._pins, pin_tokens=pin_tokens)
        self.set_prefix_caching(enabled)

    def pin_prefix(self, cmd: Pin) -> int:
        """``Pin``: pin (or unpin) in the core's ``prefix_cache``; 0 where there is none."""
        cache = getattr(self, "prefix_cache", None)
        if cache is None:
            return 0
        if cmd.ttl == 0 and cmd.owner is not None:
            cache.unpin(cmd.owner)
            return 0
        ttl = cmd.ttl if cmd.ttl is not None else cache.policy.retention_ttl(len(cmd.tokens), self.tokens_per_second)
        return cache.pin(cmd.tokens, ttl, owner=cmd.owner, next_use=cmd.next_use, partition=cmd.partition)

    def prepare_documents(self, cmd: PrepareDocuments) -> int:
        """``PrepareDocuments``: how many of the documents the core's placer (``kvreuse.documents``) holds KV for
        now; 0 where there is none."""
        placer = getattr(self, "_placer", None)
        return placer.prepare(cmd.documents, cmd.partition) if placer is not None else 0

    # ----- given to every core -------------------------------------------------------------

    def iterate(self, commands: list[Command], out: Outbox) -> None:
        self.apply(commands, out)
        counts: dict[str, int] | None = getattr(self, "token_counts", None)
        before, start = (counts.get("prefill", 0) if counts else 0), time.monotonic()
        self.step(out)
        if counts:
            done, took = counts.get("prefill", 0) - before, time.monotonic() - start
            if done >= 16 and took > 0:  # an iteration that did real work; a moving average over them
                rate = done / took
                self.tokens_per_second = rate if self.tokens_per_second is None else (
                    0.9 * self.tokens_per_second + 0.1 * rate)

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
                elif isinstance(cmd, CacheControl) and cmd.budget is not None:
                    self.resize_prefix_cache(*cmd.budget)
                    out.reply(cmd.reply)
                elif isinstance(cmd, CacheControl):
                    self.set_prefix_caching(cmd.enabled)
                    out.reply(cmd.reply)
                elif isinstance(cmd, Pin):
                    out.reply(cmd.reply, self.pin_prefix(cmd))
                elif isinstance(cmd, PrepareDocuments):
                    out.reply(cmd.reply, self.prepare_documents(cmd))
                elif isinstance(cmd, Heartbeat):
                    out.reply(cmd.reply)
            except Exception as exc:  # this command's request fails, no other
                log.exception("engine %s: %s failed", self.name, type(cmd).__name__)
                if isinstance(cmd, Decode):
                    out.fail_stream(cmd.send, self.error(exc))
                    self.release(cmd.ctx)
                elif isinstance(cmd, (Logits, CacheControl, Pin, PrepareDocuments)):
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

    def new_row(self, cmd: Decode, length: int, prompt: Sequence[int] = ()) -> Row:
        """A decoding row; a constrained one gets its matcher (compiled here, on the worker, cached per constraint).

        ``prompt``: the tokens its context holds, which ``repetition_penalty`` penalises."""
        matcher = None
        if cmd.params.constraint is not None:
            if self._constrainer is None:
                self._constrainer = constraints.Constrainer(self.tokenizer, self.vocab_size, self.eos)
            try:
                matcher = self._constrainer.matcher(cmd.params.constraint)
            except constraints.ConstraintError as exc:
                raise EngineError(f"the output constraint does not compile: {exc}") from None
        p = cmd.params
        detok = Detokenizer(self.tokenizer, p.stop, min_tokens=p.min_tokens)
        history = NO_HISTORY if p.neutral_logits else History(
            prompt=prompt if p.repetition_penalty != 1 else (), output=detok.ids,
            stops=frozenset(self.eos) | frozenset(p.stop_token_ids))
        return Row(ctx=cmd.ctx, params=p, send=cmd.send, free_after=cmd.free_after, priority=cmd.priority,
                   generator=make_generator(p.seed), detok=detok, length=length, matcher=matcher,
                   preemptive=cmd.preemptive, keep_context=cmd.keep_context, history=history)

    def emit(self, r: Row, token: int, out: Outbox, logits: torch.Tensor | None = None) -> bool:
        """Record one sampled token of ``r`` (its KV holds ``r.length`` tokens); True when the row is finished.

        ``logits``: the row (V,) the token was sampled from, for a request that asked for logprobs."""
        r.produced += 1
        wanted = r.params.logprobs
        logprobs = (token_logprob(logits, token, wanted),) if wanted is not None and logits is not None else ()
        finish = None
        if (token in self.eos and not r.params.ignore_eos) or token in r.params.stop_token_ids:
            text, finish = r.detok.flush(), "stop"  # the token ends it, unsaid (vLLM's stop_token_ids too)
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
        delta = TokenDelta(text=text, token_ids=[token], finish_reason=finish, logprobs=logprobs)
        if r.held is not None:
            delta, r.held = r.held.then(delta), None
        if finish is None and r.produced > 1 and len(delta.token_ids) < self.stream_interval:
            r.held = delta
            return False
        out.deltas.append((r.send, delta, finish is not None))
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
        return list(sample(logits, [r.params for r in rows], [r.generator for r in rows], mask,
                           [r.history for r in rows]))
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
    return sample(logits.unsqueeze(0), [r.params], [r.generator], mask, [r.history])[0]


def sample_rows_numpy(rows: Sequence[Row], logits: np.ndarray) -> list[int | BaseException]:
    """``sample_rows`` for a core whose logits are a numpy array (B, V) (llama.cpp's buffer, copied out).

    A greedy row with no constraint, bias or penalty takes its argmax in numpy, so the common case costs no
    torch op on the per-token path (a torch op runs an OpenMP team of its own, which contends with the
    engine's own threads for the same cores); the other rows go through the shared sampler, failing alone."""
    tokens: list[int | BaseException] = [0] * len(rows)
    rest = []
    for i, r in enumerate(rows):
        if r.matcher is None and is_greedy(r.params) and r.params.neutral_logits:
            tokens[i] = int(logits[i].argmax())
        else:
            rest.append(i)
    if rest:
        for i, token in zip(rest, sample_rows([rows[i] for i in rest], torch.from_numpy(logits[rest]))):
            tokens[i] = token
    return tokens


def logprobs_row(r: Row, logits: np.ndarray) -> torch.Tensor | None:
    """One row of numpy logits (V,) as ``emit`` takes them: only for a request that asked for logprobs."""
    return torch.from_numpy(logits) if r.params.logprobs is not None else None


def prefill_answer(job: Prefill, cached: int, next_logits: np.ndarray | torch.Tensor) -> int | tuple[int, torch.Tensor]:
    """A finished (unscored) prefill's reply: the prompt tokens its cache held, with its next-token logits of
    ``job.next_logits_of`` when it asks for them (``ScoresThroughCache``)."""
    if not job.next_logits_of:
        return cached
    return cached, torch.as_tensor(next_logits)[list(job.next_logits_of)].float().clone()
