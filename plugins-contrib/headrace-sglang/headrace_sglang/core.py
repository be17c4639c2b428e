"""``SGLangCore``: SGLang's offline ``Engine`` on the shared LLM front's worker thread.

The front (``LLMFront``, on the daemon's event loop) checks requests and posts commands; this core
turns each one into SGLang requests. ``Engine.generate(stream=True)``, SGLang's synchronous API,
serves one stream per call (each ``next`` runs the Engine's loop until that stream's next chunk),
so it cannot interleave many streams and still take new commands. The core therefore drives the
Engine's asyncio API on the Engine's own private event loop, which belongs to the worker thread
(``load_on_worker``: the Engine is built there, and makes that loop then): every SGLang request is a
task on it, and each iteration's ``step`` runs the loop until some request has news (at most
``SLICE`` seconds), collecting replies and deltas into the iteration's ``Outbox``.

A KV context is its token list (the parent's tokens plus its own). A prefill is a prefill-only
request (``max_new_tokens = 0``) that leaves its KV in SGLang's radix cache; a decode runs the real
request on the whole list (a radix-cache hit) and streams deltas; ``generate`` records its tokens
only (``Hold``) and its decode is its one request (``TokenListCore``, shared with headrace-vllm). Stopping a context cancels its requests' tasks,
which abort them in SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import multiprocessing
import threading
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from headrace.plugins.api import (Command, ContextId, Decode, EngineEnv, EngineError, EngineFailed, Logits, Outbox,
                                  Prefill, Reply, TokenDelta, TokenIds, TokenListCore, safetensors_model)
from headrace_sglang.options import SGLangOptions, StopText, sampling_params
from headrace_sglang.processes import (engine_class, prepare_sglang_process, prompt_limit, shut_down,
                                       stop_processes)

log = logging.getLogger("headrace_sglang")

# Seconds one iteration runs SGLang's loop waiting for news before it takes new commands: a command
# waits at most this long while requests run (a GPU decode step takes about as long).
SLICE = 0.005
IDLE_CHECK = 1.0  # seconds: while idle, the worker still looks at SGLang's processes this often
SHUTDOWN_GRACE = 10.0  # seconds the tasks get to abort their requests when the engine stops
PREFILL_ONLY = {"max_new_tokens": 0, "temperature": 0.0}
FINISH_REASONS = {"stop": "stop", "length": "length"}


@dataclass
class _FlushCache:
    reply: Reply  # resolved with True when SGLang emptied its radix cache


@dataclass
class _Scoring:
    """A ``Logits`` job in flight: one SGLang request per prompt, all at once."""

    job: Logits
    scores: torch.Tensor
    rids: set[str] = field(default_factory=set)  # those not finished yet


@dataclass
class _Request:
    """One SGLang request the core serves: a prefill, a decode or a scoring prompt."""

    op: str  # "prefill", "decode" or "score": the batch observation it counts in
    sent: float  # when it was submitted (batch metrics)
    ctx: ContextId | None = None
    reply: Reply | None = None  # a prefill's
    send: Any = None  # a decode's stream
    free_after: bool = False  # a generate()'s decode: its context goes when it ends
    stops: StopText | None = None  # a decode's stop strings, applied to SGLang's text
    scoring: _Scoring | None = None  # a scoring prompt's job
    row: int = 0  # ... and its row there
    task: asyncio.Task | None = None


def finish_reason(item: dict[str, Any], engine: str) -> str | None:
    """The headrace finish reason of one SGLang output, None while it runs; an abort is an EngineError."""
    reason = item.get("meta_info", {}).get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind in FINISH_REASONS:
        return FINISH_REASONS[kind]
    message = reason.get("message") if isinstance(reason, dict) else None
    raise EngineError(f"engine {engine!r}: SGLang ended the request: {message or kind}")


def token_scores(item: dict[str, Any], token_ids: Sequence[int], engine: str) -> torch.Tensor:
    """A scoring request's log-probabilities of ``token_ids`` (SGLang's ``output_token_ids_logprobs``)."""
    per_position = item.get("meta_info", {}).get("output_token_ids_logprobs") or [None]
    got = {int(entry[1]): float(entry[0]) for entry in per_position[0] or () if entry[0] is not None}
    missing = [t for t in token_ids if t not in got]
    if missing:
        raise EngineError(f"engine {engine!r}: SGLang returned no log-probability for token id(s) {missing}")
    return torch.tensor([got[t] for t in token_ids], dtype=torch.float32)


class SGLangCore(TokenListCore):
    """SGLang's ``Engine`` driven on the front's worker thread, its requests tasks on the Engine's loop."""

    load_on_worker = True  # the Engine's private event loop belongs to the thread that builds it

    def __init__(self, name: str, options: SGLangOptions, model_ref: str, env: EngineEnv) -> None:
        super().__init__(name, options.context_length or 0)
        self.options = options
        self._model_ref = model_ref
        self._key = f"engines.{name}.model"
        self._env = env
        self.engine: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the Engine's, run only by the worker thread
        self._processes: list[multiprocessing.Process] = []
        self._receiver: asyncio.Task | None = None  # SGLang's output loop
        self.child_quit = threading.Event()  # set by the front's SIGQUIT handler: an SGLang process failed
        self._requests: dict[str, _Request] = {}  # request id -> what it serves
        self._of_context: dict[ContextId, set[str]] = {}  # a context's requests, aborted when it stops
        self._tasks: set[asyncio.Task] = set()  # every task on the loop not finished yet
        self._scoring: list[_Scoring] = []
        self._unscored: list[Logits] = []  # jobs with no token ids: answered in the next step
        self._out: Outbox | None = None  # the outbox of the iteration running the loop
        self._news: asyncio.Event | None = None
        self._can_score = False
        self._takes_priority = False
        self._last_output_at: float | None = None
        self.cached_tokens = 0  # prompt tokens the radix cache served, all requests so far
        self.unfinished = 0  # requests in SGLang, as of the worker's last look

    # ----- loading and stopping (on the worker thread) ------------------------------------

    def load(self) -> None:
        if not torch.cuda.is_available():
            raise EngineError(f"engine {self.name!r}: SGLang runs on a CUDA GPU, and torch sees none here")
        path = safetensors_model(self._model_ref, self._key, self._env.cache_dir)  # SGLang loads safetensors
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        prepare_sglang_process()
        self.engine, self._processes = self._start(path)
        try:
            self._attach()
        except BaseException:
            shut_down(self.engine, self._processes)
            self.engine = None
            raise

    def _attach(self) -> None:
        """Read SGLang's limits, and take its output loop onto the Engine's own event loop."""
        # Built off any running loop, the Engine made a loop of its own for this thread (its synchronous
        # methods run it); older releases may not have.
        loop = getattr(self.engine, "loop", None)
        if not isinstance(loop, asyncio.AbstractEventLoop) or loop.is_closed():
            loop = asyncio.new_event_loop()
        self.loop = loop
        manager = self.engine.tokenizer_manager
        self.vocab_size = int(manager.model_config.vocab_size)
        self.max_context_tokens = prompt_limit(manager)
        accepted = inspect.signature(self.engine.async_generate).parameters
        self._can_score = "token_ids_logprob" in accepted
        self._takes_priority = "priority" in accepted
        manager.on_output_batch = self._observe_outputs
        # SGLang starts its output loop on first use as a task nobody owns, which kills the whole process
        # when it fails. Marked started, it does not: the core runs that loop and fails the engine instead.
        manager.event_loop = loop
        self._news = asyncio.Event()
        self._receiver = loop.create_task(manager.handle_loop())

    def _start(self, path: Path) -> tuple[Any, list[multiprocessing.Process]]:
        """SGLang's Engine and the processes it started."""
        policy = asyncio.get_event_loop_policy()
        try:
            engine_cls = engine_class()
        except Exception as exc:
            raise EngineError(f"engine {self.name!r}: sglang failed to import: {type(exc).__name__}: {exc}") from exc
        finally:
            asyncio.set_event_loop_policy(policy)  # importing sglang makes uvloop every later loop's default
        before = set(multiprocessing.active_children())
        try:
            engine = engine_cls(**self.options.engine_kwargs(path))
        except Exception as exc:
            stop_processes([p for p in multiprocessing.active_children() if p not in before])
            raise EngineError(f"engine {self.name!r}: SGLang failed to start: {type(exc).__name__}: {exc}") from exc
        return engine, [p for p in multiprocessing.active_children() if p not in before]

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        try:
            yield
        finally:  # on the worker thread, which owns the loop: the requests end, then SGLang's processes
            self._close()

    def _close(self) -> None:
        loop, engine = self.loop, self.engine
        if loop is None or engine is None:
            return
        self._out = Outbox()  # nobody reads it: abandon() answers what is left
        tasks = [t for t in (*self._tasks, self._receiver) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=SHUTDOWN_GRACE))
        except Exception:
            log.exception("engine %s: stopping SGLang's requests failed", self.name)
        finally:
            self.engine = None
            shut_down(engine, self._processes)
            loop.close()
            self.loop = None
            asyncio.set_event_loop(None)

    # ----- commands ---------------------------------------------------------------------

    def apply(self, commands: list[Command], out: Outbox) -> None:
        run: list[Command] = []
        for cmd in commands:
            if isinstance(cmd, _FlushCache):
                self._spawn(self._flush_cache(cmd.reply))
            else:
                run.append(cmd)
        super().apply(run, out)

    def prefill_request(self, job: Prefill, tokens: TokenIds) -> None:
        # Prefill only: its one purpose is to leave the tokens' KV in the radix cache.
        self._submit(tokens, dict(PREFILL_ONLY), job.priority, _Request("prefill", 0.0, ctx=job.ctx, reply=job.reply))

    def start_decode(self, cmd: Decode, out: Outbox) -> None:
        tokens = self.contexts.get(cmd.ctx)
        if tokens is None:
            raise EngineError(f"context {cmd.ctx!r} does not exist")
        p = cmd.params
        # SGLang refuses a prompt plus max_new_tokens over the context; headrace ends it there ("length").
        sampling = sampling_params(p, min(p.max_tokens, self.max_context_tokens - len(tokens)))
        self._submit(tokens, sampling, cmd.priority, _Request(
            "decode", 0.0, ctx=cmd.ctx, send=cmd.send, free_after=cmd.free_after,
            stops=StopText(tokenizer=None, stop=tuple(p.stop))))

    def add_scoring(self, job: Logits) -> None:
        if not self._can_score:
            raise EngineError(f"engine {self.name!r}: this sglang has no token_ids_logprob in "
                              f"Engine.async_generate; scoring needs a newer sglang")
        if not job.token_ids:
            self._unscored.append(job)
            return
        scoring = _Scoring(job, torch.empty(len(job.prompts), len(job.token_ids), dtype=torch.float32))
        self._scoring.append(scoring)
        wanted = sorted(set(job.token_ids))
        # All prompts go in at once: SGLang batches them with whatever else is running.
        for row, prompt in enumerate(job.prompts):
            scoring.rids.add(self._submit(prompt, dict(PREFILL_ONLY), job.priority,
                                          _Request("score", 0.0, scoring=scoring, row=row),
                                          return_logprob=True, token_ids_logprob=wanted))

    def stop(self, ctx: ContextId, free: bool) -> None:
        for rid in list(self._of_context.pop(ctx, ())):
            self._cancel(rid)
        if free:
            self.release(ctx)

    # ----- one iteration ----------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._tasks or self._unscored)

    def wake_after(self) -> float | None:
        return IDLE_CHECK  # an SGLang process that dies while nothing runs still fails the engine

    def step(self, out: Outbox) -> None:
        self._check_sglang()
        for job in self._unscored:
            out.reply(job.reply, torch.empty(len(job.prompts), 0, dtype=torch.float32))
        self._unscored.clear()
        for scoring in [s for s in self._scoring if s.job.reply.abandoned]:  # the caller left
            self._end_scoring(scoring)
        if self._tasks:
            self._out = out
            try:
                # Nothing to wait for when this iteration already has something to hand back.
                self.loop.run_until_complete(self._until_news(0.0 if out.deltas or out.replies else SLICE))
            finally:
                self._out = None
        self.unfinished = len(self._requests)

    async def _until_news(self, timeout: float) -> None:
        self._news.clear()
        if timeout <= 0:
            await asyncio.sleep(0)  # one pass: every task ready to run runs
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._news.wait(), timeout)

    def _check_sglang(self) -> None:
        """Fail the engine (not a request) when SGLang cannot go on: a process of it ended, or its output loop."""
        dead = [p for p in self._processes if not p.is_alive()]
        if dead:
            raise EngineFailed(f"engine {self.name!r}: SGLang's process {dead[0].name} (pid {dead[0].pid}) exited "
                               f"with code {dead[0].exitcode}")
        if self.child_quit.is_set():
            raise EngineFailed(f"engine {self.name!r}: an SGLang process failed (it signalled SIGQUIT)")
        if self._receiver is not None and self._receiver.done():
            exc = None if self._receiver.cancelled() else self._receiver.exception()
            raise EngineFailed(f"engine {self.name!r}: SGLang's output loop "
                               + (f"failed: {type(exc).__name__}: {exc}" if exc else "ended"))

    # ----- SGLang requests, as tasks on its loop --------------------------------------------

    def _spawn(self, coroutine: Any) -> asyncio.Task:
        task = self.loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _submit(self, tokens: TokenIds, sampling: dict[str, Any], priority: int, request: _Request,
                **extra: Any) -> str:
        # Fixed-length ids: SGLang aborts every request whose id starts with the aborted one.
        rid = uuid.uuid4().hex
        kwargs: dict[str, Any] = dict(input_ids=list(tokens), sampling_params=sampling, stream=True, rid=rid, **extra)
        if self._takes_priority:
            kwargs["priority"] = priority
        request.sent = time.monotonic()
        self._requests[rid] = request
        if request.ctx is not None:
            self._of_context.setdefault(request.ctx, set()).add(rid)
        request.task = self._spawn(self._serve(rid, request, kwargs))
        return rid

    async def _serve(self, rid: str, request: _Request, kwargs: dict[str, Any]) -> None:
        """One SGLang request, streamed into the iteration's outbox; leaving early aborts it."""
        finished = False
        try:
            outputs = await self._refusing(self.engine.async_generate(**kwargs))  # an async generator
            async with aclosing(outputs):
                while not finished:
                    try:
                        item = await self._refusing(outputs.__anext__())
                    except StopAsyncIteration:
                        raise EngineError(f"engine {self.name!r}: SGLang ended the request without finishing it")
                    finished = finish_reason(item, self.name) is not None
                    if finished:
                        self.cached_tokens += int(item.get("meta_info", {}).get("cached_tokens") or 0)
                    if self._requests.get(rid) is not request or not self._take(rid, request, item, finished):
                        return  # stopped meanwhile, or a stop string ended it
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # this request fails alone
            if self._forget(rid) is request:
                self._fail(request, self.error(exc))
        finally:
            if not finished:
                try:
                    self.engine.tokenizer_manager.abort_request(rid)  # a no-op once SGLang has let it go
                except Exception:
                    log.exception("engine %s: aborting %s failed", self.name, rid)

    async def _refusing(self, awaitable: Any) -> Any:
        """Await SGLang; what it raises (a request it refuses) becomes the request's EngineError."""
        try:
            return await awaitable
        except (EngineError, StopAsyncIteration, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.warning("engine %s: request refused: %s", self.name, exc)
            detail = getattr(exc, "detail", None) or str(exc) or type(exc).__name__
            raise EngineError(f"engine {self.name!r} refused the request: {detail}") from exc

    def _take(self, rid: str, request: _Request, item: dict[str, Any], finished: bool) -> bool:
        """One output of a request, as its reply, stream delta or scores; False once the request is done."""
        finish = finish_reason(item, self.name) if finished else None
        out = self._out
        self._news.set()
        if request.op == "decode":
            text, stopped = request.stops.add_text(item.get("text") or "")
            ids = list(item.get("output_ids") or ())
            if stopped:
                finish = "stop"  # leaving the request aborts it
            elif finish is not None:
                text += request.stops.flush()
            if finish is not None:
                self._forget(rid)
                out.deltas.append((request.send, TokenDelta(text=text, token_ids=ids, finish_reason=finish), True))
                if request.free_after:
                    self.release(request.ctx)
                return False
            if text or ids:
                out.deltas.append((request.send, TokenDelta(text=text, token_ids=ids), False))
            return True
        if finish is None:
            return True
        self._forget(rid)
        if request.op == "prefill":
            out.reply(request.reply)
        else:
            scoring = request.scoring
            scoring.scores[request.row] = token_scores(item, scoring.job.token_ids, self.name)
            scoring.rids.discard(rid)
            if not scoring.rids:
                self._end_scoring(scoring)
                out.reply(scoring.job.reply, scoring.scores)
        return False

    async def _flush_cache(self, reply: Reply) -> None:
        try:
            result = await self.engine.tokenizer_manager.flush_cache()
            self._out.reply(reply, bool(getattr(result, "success", result)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._out.reply(reply, error=EngineError(f"engine {self.name!r}: flushing the radix cache failed: {exc}"))
        self._news.set()

    # ----- ending requests -----------------------------------------------------------------

    def _forget(self, rid: str) -> _Request | None:
        request = self._requests.pop(rid, None)
        if request is not None and request.ctx is not None:
            self._of_context.get(request.ctx, set()).discard(rid)
        return request

    def _cancel(self, rid: str) -> None:
        """Stop serving a request: its task ends and aborts it in SGLang."""
        request = self._forget(rid)
        if request is not None and request.task is not None:
            request.task.cancel()

    def _end_scoring(self, scoring: _Scoring) -> None:
        for rid in list(scoring.rids):
            self._cancel(rid)
        scoring.rids.clear()
        if scoring in self._scoring:
            self._scoring.remove(scoring)

    def _fail(self, request: _Request, error: BaseException, out: Outbox | None = None) -> None:
        """Answer one request with ``error`` (a scoring prompt's failure is its whole job's)."""
        out = out or self._out
        if request.op == "decode":
            out.fail_stream(request.send, error)
            if request.free_after:
                self.release(request.ctx)
        elif request.op == "prefill":
            self.release(request.ctx)
            out.reply(request.reply, error=error)
        elif request.scoring in self._scoring:
            self._end_scoring(request.scoring)
            out.reply(request.scoring.job.reply, error=error)
        self._news.set()

    def recover(self, exc: BaseException, out: Outbox) -> None:
        error = self.error(exc)
        for rid, request in list(self._requests.items()):
            if self._requests.get(rid) is request:
                self._cancel(rid)
                self._fail(request, error, out)

    def abandon(self, error: BaseException, out: Outbox) -> None:
        # SGLang has gone with the worker (serving() ended); the front answers every request still waiting.
        self._requests.clear()
        self._of_context.clear()
        self.contexts.clear()
        self._scoring.clear()
        self._unscored.clear()
        self._tasks.clear()

    def stats(self) -> dict[str, int]:
        return {"contexts": len(self.contexts), "requests": self.unfinished, "cached_tokens": self.cached_tokens}

    # ----- metrics ----------------------------------------------------------------------

    def _observe_outputs(self, rids: Sequence[str]) -> None:
        """Called by SGLang's output loop with the requests of one batch of outputs (one scheduler step).

        The step ran in SGLang's scheduler process: its span is taken from the previous batch of
        outputs, or from when its earliest request was sent if that is later.
        """
        try:
            now = time.monotonic()
            sizes: dict[str, int] = {}
            sent = now
            for rid in rids:
                request = self._requests.get(rid)
                if request is not None:
                    sizes[request.op] = sizes.get(request.op, 0) + 1
                    sent = min(sent, request.sent)
            start = max(sent, self._last_output_at or sent)
            for op, size in sizes.items():
                self._env.observe_batch(op, size, min(start, now), now)
            self._last_output_at = now
        except Exception:  # never let a metric break SGLang's output loop
            log.exception("engine %s: observing a batch failed", self.name)
