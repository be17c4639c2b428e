"""What the LLM front and an engine's core pass each other: the commands the front posts to the
worker thread, the replies and token deltas the worker hands back (an :class:`Outbox` per
iteration), and the one error type every LLM engine raises.

See ``front`` for the two halves, ``core`` for how a core plugs in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import torch

from headrace.plugins.engines.llm.prompt_scores import PromptScoring
from headrace.plugins.protocols import SamplingParams, TokenDelta
from headrace.types import ContextId, TokenIds


class EngineError(RuntimeError):
    """A request the engine cannot serve (unknown context, context too long...)."""


class EngineFailed(EngineError):
    """Raised by a core's iteration when the engine cannot go on (a process of the engine's has died): the
    worker stops and the front's ``run`` fails with it, so the pool marks the engine failed."""


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


class TokenStream:
    """One decode's output on the event loop: what ``deliver_on_loop`` sends, read by the decode's ``async for``.

    In place of an anyio memory object stream, whose ``receive`` yields to the loop before it looks (a
    checkpoint): one loop callback per token per stream on top of the wake itself. Here a reader waiting is
    woken once per delivery and a reader behind takes what is there without yielding. Unbounded, as a decode
    gets one item per token at most, then its end or an error. The same errors as a memory stream: sending
    after ``close`` is ``ClosedResourceError``, after the reader left (``leave``) ``BrokenResourceError``."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._closed = False  # nothing more will be sent
        self._left = False  # the reader went away
        self._wake: anyio.Event | None = None  # set when the reader waits

    def send_nowait(self, item: Any) -> None:
        if self._left:
            raise anyio.BrokenResourceError
        if self._closed:
            raise anyio.ClosedResourceError
        self._items.append(item)
        self._notify()

    def close(self) -> None:
        self._closed = True
        self._notify()

    def leave(self) -> None:
        """The reader is done: what is held goes, later sends fail."""
        self._left = True
        self._items.clear()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> Any:
        while not self._items:
            if self._closed or self._left:
                raise StopAsyncIteration
            self._wake = anyio.Event()
            await self._wake.wait()
        return self._items.popleft()


@dataclass
class Prefill:
    ctx: ContextId
    tokens: TokenIds
    parent: ContextId | None
    reply: Reply  # resolved once the context holds the tokens: with how many its prefix cache held (or None)
    priority: int = 0  # lower runs first (the LLM scheduler's policy sets it)
    preemptive: bool = False  # may pause preemptive decodes of a lower rank (``preemption``)
    # Teacher-forced: logits at every position, and the reply is a ``PromptLogprobs`` (its prompt is computed
    # whole: no prefix-cache hit or tier restore, whose positions would have no logits).
    scoring: PromptScoring | None = None
    # The cached KV it may reuse and adds to (``IsolatesCaches``): only that of prefills of the same partition.
    partition: str = ""
    # A child prefill an engine turned into a fresh prompt (its parent's tokens, then its own) because its cache
    # held a longer prefix of that whole than the parent: the parent's length, which its reply's count of cached
    # tokens leaves out (the parent's prefill counted them).
    rebased: int = 0
    # Retrieved documents in ``tokens``, each (start, length) and tokenized alone: a core that places documents
    # (``PlacesDocuments``) may put their KV, computed once, there rather than prefill them; any other prefills all.
    documents: tuple[tuple[int, int], ...] = ()
    # Scored through the cache (``ScoresThroughCache``): a plain prefill whose reply is (the tokens its prefix cache
    # held, the logits of these token ids after the prompt), so what it reuses is restored, not computed.
    next_logits_of: tuple[int, ...] = ()


@dataclass
class Decode:
    ctx: ContextId
    params: SamplingParams
    send: Any  # a TokenStream of TokenDelta | BaseException
    free_after: bool  # generate(): the context goes when the decode ends
    priority: int = 0
    preemptive: bool = False  # may pause, and be paused by, preemptive work of another rank (``preemption``)
    keep_context: bool = False  # once it ends, its whole context may go to the prefix cache (``KeepsContexts``)


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
    """Switch the core's prefix cache on or off (off drops what it holds); with ``budget``, (tokens, pin tokens):
    size it anew instead (``enabled`` unused), emptied."""

    enabled: bool
    reply: Reply
    budget: tuple[int, int] | None = None


@dataclass
class Pin:
    """Pin the cached prefix of ``tokens`` (``PrefixCache.pin``); with an ``owner`` and ``ttl`` 0, unpin the
    owner's. ``ttl`` None: the engine's retention TTL for that many tokens (``PinPolicy.retention_ttl``)."""

    tokens: TokenIds
    ttl: float | None
    owner: str | None
    next_use: float | None  # seconds until the owner is predicted back; None: unknown
    reply: Reply  # resolved with the tokens pinned (0: nothing cached, or the budget is full)
    partition: str = ""  # the cache partition the entry is looked up in (``Prefill.partition``)


@dataclass
class Heartbeat:
    """Answered as soon as the worker takes it, so the answer comes after the iteration in progress."""

    reply: Reply


@dataclass
class PrepareDocuments:
    """Compute and keep each document's KV (each tokenized alone) in ``partition``, so later prefills may place
    it (``Prefill.documents``); the reply: how many are held now."""

    documents: list[TokenIds]
    reply: Reply
    partition: str = ""


Command = Prefill | Decode | Stop | Logits | CacheControl | Pin | Heartbeat | PrepareDocuments


@dataclass
class Outbox:
    """What one worker iteration hands back to the event loop in a single call (and, through ``hand_over``, what
    is ready before the iteration's decode)."""

    deltas: list[tuple[Any, TokenDelta | BaseException, bool]] = field(default_factory=list)
    replies: list[tuple[Reply, Any, BaseException | None]] = field(default_factory=list)
    # How the worker hands an outbox to the event loop (the front's); None: only at the iteration's end.
    early: Callable[[Outbox], Any] | None = field(default=None, repr=False, compare=False)

    def hand_over(self) -> None:
        """Hand what is here to the event loop now, before the rest of the iteration runs: a first token sampled
        from its prefill's logits reaches its client before the decode step that follows, not after it (as
        llama-server sends it). Deliveries run on the loop in order, so a stream's deltas stay in order."""
        if self.early is None or not (self.deltas or self.replies):
            return
        ready = Outbox(self.deltas, self.replies)
        self.deltas, self.replies = [], []
        self.early(ready)

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

